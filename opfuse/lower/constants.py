"""Small constant tensors read as formulas instead of loads.

A constant whose elements are all equal (a folded `full`, `scalar_tensor`) is its value.

Autograd writes the gradient of `select` / `unbind` as `where(arange(n) == i, grad, 0)`,
and constant folding turns `arange(n) == i` into a stored [n, 1, ..] mask. A kernel that
loads the mask cannot tell which elements it selects, so it reads every branch at every
element (the qkv gradient of an attention layer read all three gradients three times). A
mask that is an interval along one dimension, and constant along the others, is the test
`lo <= i < hi` on that dimension's index: the kernel computes it, and the loop cutting of
lower/unswitch.py and lower/split.py can decide it per range and drop the dead branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..ir.index import Ix
from ..ir.scalar import Expr, binary, const, position

MAX_NUMEL = 1 << 12  # larger masks stay loads (the test below reads every element)


def formula(t: torch.Tensor, index: Sequence[Ix]) -> Expr | None:
    """Constant `t` at `index` of its shape, computed rather than loaded; None to load it."""
    if t.numel() == 0 or t.numel() > MAX_NUMEL or t.dtype.is_complex:
        return None
    first = t.reshape(-1)[0]
    # (never for NaN, which equals nothing; -0.0 and 0.0 are told apart by their sign)
    same = t == first
    if t.dtype.is_floating_point:
        same &= t.signbit() == first.signbit()
    if bool(same.all()):
        value: Any = first.item()
        return const(value, t.dtype)
    found = interval(t)
    return None if found is None else position_test(found, index, t.shape[found[0]])


def interval(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, lo, hi) when bool tensor `t` is true exactly where lo <= index[dim] < hi;
    (-1, 0, 0) when it is all false and (-1, 0, 1) when all true; else None."""
    if t.dtype != torch.bool or t.numel() == 0 or t.numel() > MAX_NUMEL:
        return None
    first = t.reshape(-1)[0]
    if bool((t == first).all()):
        return (-1, 0, int(bool(first)))
    varying = [d for d in range(t.dim()) if t.shape[d] > 1 and not _constant_along(t, d)]
    if len(varying) != 1:
        return None
    d = varying[0]
    line = t  # the line along d at index 0 of every other dimension: all lines alike
    for other in range(t.dim()):
        if other != d:
            line = line.narrow(other, 0, 1)
    where = line.reshape(-1).nonzero().reshape(-1)
    lo, hi = int(where[0]), int(where[-1]) + 1
    if hi - lo != where.numel():
        return None  # true at positions with gaps: no single interval
    return d, lo, hi


def _constant_along(t: torch.Tensor, d: int) -> bool:
    return bool((t == t.narrow(d, 0, 1)).all())


def position_test(found: tuple[int, int, int], index: Sequence[Ix], size: int) -> Expr:
    """The bool expression `interval` describes, at `index` of the mask's shape (`size`:
    the extent of the tested dimension)."""
    d, lo, hi = found
    if d < 0:
        return const(hi > lo, torch.bool)
    at = position(index[d])
    if hi - lo == 1:
        return binary("eq", at, const(lo, torch.int64))
    if lo == 0:
        return binary("lt", at, const(hi, torch.int64))
    if hi == size:
        return binary("ge", at, const(lo, torch.int64))
    above = binary("ge", at, const(lo, torch.int64))
    return binary("and", above, binary("lt", at, const(hi, torch.int64)))
