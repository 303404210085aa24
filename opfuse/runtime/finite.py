"""Finiteness guards for library calls whose fused post-op turns NaN into a number.

oneDNN computes its relu, clamp (hardtanh) and hardsigmoid post-ops with max/min
instructions that return the other operand for NaN: Conv2d + ReLU on an input with one NaN
pixel gives 0 where eager gives NaN (72 values of a 3x3 conv with 8 channels). Such a call
runs fused only when no NaN can reach its post-op, which is the case when every input is
finite and no sum can overflow:

    |conv(x) + b (+ other)|  <=  gain * max|x| + max|b| (+ max|other|)  <=  LIMIT

where gain is the largest sum of |w| over one output channel (a constant of the frozen
weight). Otherwise it runs as the call without the post-op, then the post-op with torch.

Bounds travel with the values through one call of the plan: a guarded call's result is
bounded by its post-op applied to that bound, so a chain of convolutions (ResNet) measures
its input once and then only multiplies numbers. opfuse's own kernels between them carry bounds
too, by interval arithmetic over what they compute (lower/bounds.py, `transfer`). A value
whose bound is unknown, or has grown past LIMIT through a chain, is measured: one pass
over it (a BLAS dot, ~100 GB/s).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# Far below float32's largest value (2^128): room for any summation order or algorithm
# (Winograd's transforms scale partial sums by small factors).
LIMIT = 2.0**100


@dataclass
class FiniteGuard:
    """Bounds through one library call, and the choice between its fused and exact form."""

    gain: float  # |result before the post-op| <= gain * bound(x) + offset (+ bound(other))
    offset: float
    binary: bool  # the call also adds its second argument
    # The post-op's output bound from its input bound b: max(min(b, cap), floor) (as
    # (cap, floor); backends/c/module.py's _POST_BOUND); None: unknown, nothing carried.
    post: tuple[float, float] | None
    # The same result with NaN kept (the call without its post-op, then torch's post-op);
    # None: the call keeps NaN itself, and the guard only carries bounds along.
    exact: Callable[..., Any] | None = None
    exact_calls: int = 0  # how often the exact path ran (for tests and reports)

    def choose(
        self, args: list[Any], slots: tuple[int, ...], bounds: list[float | None]
    ) -> tuple[bool, float | None]:
        """(run the fused call?, bound of its result), from the bounds of the inputs at
        `slots`. Measures inputs only where the fused call needs proof and the bounds
        carried along do not give it. Straight-line code: it runs per call and step."""
        b0 = bounds[slots[0]]
        b1 = bounds[slots[1]] if self.binary else 0.0
        pre = math.inf if b0 is None or b1 is None else self.gain * b0 + self.offset + b1
        if not pre <= LIMIT and self.exact is not None:
            # unknown, grown too large along a chain, or NaN: measure
            b0 = bounds[slots[0]] = max_abs(args[0])
            if self.binary:
                b1 = bounds[slots[1]] = max_abs(args[1])
            pre = self.gain * b0 + self.offset + b1  # type: ignore[operator]
            if not pre <= LIMIT:
                self.exact_calls += 1
                return False, None
        post = self.post
        if post is None or not pre <= LIMIT:
            return True, None
        return True, max(min(pre, post[0]), post[1])


def transfer(outputs: Mapping[int, str], reads: Iterable[int]) -> Callable[[list[Any]], None]:
    """The bounds through one of opfuse's kernels (lower/bounds.py): a function setting
    bounds[slot] for each of `outputs` (slot -> Python source over `b[i]`, the bounds of
    the slots `reads`), and nothing where one of those has no bound this call. A result
    past LIMIT, or NaN, is no bound. One compiled function per step: the runtime calls it
    after the kernel, on every call of a plan with guards."""
    reads = sorted(set(reads))
    check = " or ".join(f"b[{i}] is None" for i in reads) or "False"
    lines = ["def transfer(b):", f"    if {check}:", "        return"]
    for slot, text in outputs.items():
        lines += [f"    r = {text}", f"    b[{slot}] = r if r <= LIMIT else None"]
    scope: dict[str, Any] = {"LIMIT": LIMIT, "INF": math.inf, "max": max}
    exec(compile("\n".join(lines), "<bounds>", "exec"), scope)  # our own source, above
    fn: Callable[[list[Any]], None] = scope["transfer"]
    return fn


def gain(weight: torch.Tensor) -> float:
    """The largest sum of |w| over one output channel (dim 0): the factor by which a
    convolution or linear can grow max|x|. NaN or inf weights give NaN or inf: never
    fused."""
    w = weight.detach()
    if w.numel() == 0:
        return 0.0
    # float32 sums: their relative error (K * 2^-24) is nothing beside LIMIT's margin, and
    # they take ResNet-50's weights in 10 ms where float64 took 30-170
    rows = w.reshape(w.shape[0], -1).float()
    return float(rows.abs().sum(1).max())


def largest(t: torch.Tensor | None) -> float:
    """max|t| (0 for None or empty; inf for NaN)."""
    if t is None or t.numel() == 0:
        return 0.0
    m = float(t.detach().abs().max())
    return math.inf if math.isnan(m) else m


def max_abs(t: torch.Tensor) -> float:
    """An upper bound of max|t|: inf when t holds NaN or inf. One pass over t."""
    if t.numel() == 0:
        return 0.0
    if t.dtype == torch.float32 and _dense(t):
        flat = t.as_strided((t.numel(),), (1,), t.storage_offset())
        s = float(torch.dot(flat, flat))  # sqrt(sum x^2) >= max|x|, at memory speed
        if s < math.inf:
            return math.sqrt(s)
        if math.isnan(s):
            return math.inf
    return largest(t)  # squares overflowed (|x| > 1e19), or another dtype or layout


def _dense(t: torch.Tensor) -> bool:
    if t.is_contiguous():
        return True
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)
