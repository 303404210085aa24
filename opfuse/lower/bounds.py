"""Bounds of a kernel's outputs from bounds of its inputs, for the finiteness guards.

A guarded library call (runtime/finite.py) runs fused only where the bounds of its inputs
prove that no NaN can reach its post-op. Bounds travel through library calls; through
opfuse's own kernels they did not, so a chain that alternates them (ResNet: each 3x3
convolution on oneDNN reads a 1x1 convolution run as opfuse's GEMM) measured the input
of every guarded call, one pass over it each (22 a call for ResNet-50).

Here a kernel's stored values are bounded by interval arithmetic over its scalar
expressions, each primitive by its `bound` rule in the op table (ir/scalar.PRIMS): a bound
of |value| from bounds of |operands|. The result is Python source over the bounds the
runtime holds per value slot, compiled once per step (runtime/finite.transfer). Whatever
cannot be bounded (a reduction, exp, a division, another dtype) leaves the output
unbounded, and the guard measures it as before.

Sound for float32 kernels: with every input finite and bounded, each intermediate is
bounded by its expression's value. An intermediate that may overflow float32 would need a
bound past `finite.LIMIT` (far below float32's largest), and a bound past LIMIT counts as
no bound: a bounded-range function ("unit") of such an operand gets none either, so a NaN
made inside a kernel (inf - inf) is never bounded by 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..ir.scalar import PRIMS, Expr
from ..ir.size import is_size
from .kernel import Kernel, Store

# What the runtime's bound of one input buffer is, as Python source: a slot's bound
# ("b[3]"), a number, or an expression of them (a GEMM's result: "(g * b[3])").
Leaf = str


def output_bounds(kernel: Kernel, leaf: Callable[[str], Leaf | None]) -> dict[str, str]:
    """For each output buffer of `kernel` whose every stored value is bounded: Python source
    of a bound of |value| over the leaves `leaf(buffer)` gives for its input buffers (None:
    unbounded). Outputs that cannot be bounded are left out."""
    stores: dict[str, list[Store]] = {}
    for s in _stores(kernel):
        stores.setdefault(s.buffer, []).append(s)
    dtypes = {b.name: b.dtype for b in kernel.buffers}
    memo: dict[Expr, str | None] = {}
    out: dict[str, str] = {}
    for buf, ss in stores.items():
        if dtypes.get(buf) != torch.float32:
            continue
        texts = [_bound(s.value, leaf, memo) for s in ss]
        if all(t is not None for t in texts):
            unique = sorted(set(t for t in texts if t is not None))
            out[buf] = unique[0] if len(unique) == 1 else f"max({', '.join(unique)})"
    return out


def _stores(k: Kernel) -> list[Store]:
    """Every store the kernel may run: its passes', its pieces' and its cases'."""
    found: list[Store] = []
    for p in k.passes:
        found += [*p.stores, *p.after]
    for piece in k.pieces:
        found += piece.stores
    for case in k.cases:
        found += _stores(case)
    return found


def _bound(e: Expr, leaf: Callable[[str], Leaf | None], memo: dict[Expr, str | None]) -> str | None:
    if e in memo:
        return memo[e]
    memo[e] = text = _rule(e, leaf, memo)
    return text


def _rule(e: Expr, leaf: Callable[[str], Leaf | None], memo: dict[Expr, str | None]) -> str | None:
    if e.dtype == torch.bool:
        return "1.0"  # a truth value, whatever its operands were
    if e.dtype != torch.float32:
        return None
    if e.op == "const":
        if is_size(e.value):
            return None  # (a size's value would hold at this size alone)
        v = abs(float(e.value))
        return repr(v) if math.isfinite(v) else None
    if e.op == "load":
        return leaf(e.value[0])
    if e.op == "cast":
        # float32 from float32 or from a truth value (its bound above); nothing else
        src = e.args[0]
        return _bound(src, leaf, memo) if src.dtype in (torch.float32, torch.bool) else None
    prim = PRIMS.get(e.op)
    if prim is None or not prim.bound:
        return None
    args = [_bound(a, leaf, memo) for a in e.args]
    if any(a is None for a in args):
        return None
    a = [t for t in args if t is not None]
    if prim.bound == "sum":
        return f"({a[0]} + {a[1]})"
    if prim.bound == "prod":
        return f"({a[0]} * {a[1]})"
    if prim.bound == "fma":
        return f"({a[0]} * {a[1]} + {a[2]})"
    if prim.bound == "max":
        return f"max({', '.join(a)})"
    if prim.bound == "same":
        return a[0]
    if prim.bound == "unit":
        # 1 only for an operand known finite: past LIMIT it may be inf or NaN already
        return f"(1.0 if {a[0]} <= LIMIT else INF)"
    raise ValueError(f"unknown bound rule {prim.bound!r} of {e.op}")
