"""Where a float32 reduction computes in float64, beyond its accumulator.

Two rules, both about sums whose error eager avoids by computing in double (a sum of at
most SHORT_SUM terms, a pooling window, stays float32 as eager's pooling does):
- A float32 sum of terms of one sign (RMSNorm's x*x, softmax's exp, sum(relu(x))) folds runs
  of SUM_BLOCK float32 values before adding each run into float64: float32's vector width
  (RMSNorm 78% -> 84-88% of copy bandwidth, sum(relu(x)) 95-101% -> 112-128%), and such a
  sum cannot cancel. A sum of terms of either sign goes into float64 term by term: the
  float32 runs erred by a few ulps of their partial sums, and a normalisation's backward
  (subtract a row's mean gradient from every element, then sum the row again) multiplies
  that by the row's length (InstanceNorm's bias gradient was 4.8x further from float64 than
  eager's, whose batch-norm kernels sum in double).
- Arithmetic on a reduction's per-row results (rsqrt(var + eps) of LayerNorm, RMSNorm,
  InstanceNorm; a normalisation backward's sum * invstd**2 / n) continues in the float64
  the sum was made in and rounds once, as eager's CPU batch-norm kernels compute their
  statistics in double (rounding var to float32 before adding eps and taking rsqrt cost up
  to 1.5 ulps more on every element of the row). Only values computed once per row widen:
  per-element arithmetic stays float32.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..ir.combine import Combine
from ..ir.graph import Node
from ..ir.index import Var
from ..ir.scalar import Expr, cast, sign, walk
from ..ir.size import is_size

SHORT_SUM = 16
SUM_BLOCK = 512  # float32 values a one-signed sum folds before adding into float64

# ops whose float32 result on per-row operands is computed in float64
WIDENS = frozenset(
    {
        "aten.add.Tensor",
        "aten.add.Scalar",
        "aten.sub.Tensor",
        "aten.sub.Scalar",
        "aten.mul.Tensor",
        "aten.mul.Scalar",
        "aten.div.Tensor",
        "aten.div.Scalar",
        "aten.rsqrt.default",
        "aten.sqrt.default",
        "aten.reciprocal.default",
        "aten.neg.default",
        "aten.pow.Tensor_Scalar",
        "aten.clamp_min.default",
    }
)


def short_sum(combine: Combine, dtype: torch.dtype, terms: int) -> bool:
    """Whether a float32 sum accumulates in float32: one of at most SHORT_SUM terms (a
    pooling window) errs as little as eager's float32 pooling, and float64 would halve the
    vector width and convert every term (PoolFormer's 3x3 average, NHWC 8x64x56x56:
    1.67 -> 1.06 ms)."""
    # A sum over a symbolic length takes the form every length can take (ir/size.py).
    return (
        combine is Combine.SUM
        and dtype == torch.float32
        and not is_size(terms)
        and terms <= SHORT_SUM
    )


def sum_in_runs(term: Expr) -> bool:
    """Whether a float32 sum of `term` may fold float32 runs: its terms have one sign."""
    return sign(term) != 0


class RowPrecision:
    """The float32 per-row values of one kernel that are roundings of float64 ones."""

    def __init__(self) -> None:
        self.roundings: dict[Expr, Expr] = {}  # float32 value -> the float64 it rounds

    def results(self, values: Iterable[Expr]) -> None:
        """Register a reduction's results: float32 roundings of float64 accumulators."""
        self.roundings.update(
            (e, e.args[0])
            for e in values
            if e.op == "cast" and e.dtype == torch.float32 and e.args[0].dtype == torch.float64
        )

    def rounded(self, wide: Expr) -> Expr:
        """A per-row float64 value as the float32 its graph value is; later per-row
        arithmetic may take the float64 back (`widen`)."""
        narrow = cast(wide, torch.float32)
        self.roundings[narrow] = wide
        return narrow

    def widen(self, n: Node, args: dict[str, Any], inner: frozenset[Var]) -> bool:
        """Whether pointwise node `n` computes in float64: a float32 op of WIDENS whose
        every tensor operand is a per-row value (reduction results, constants, loads that
        do not move along the reduced loop variables `inner`) and one of them a rounding of
        a float64 row value. If so, those operands in `args` become the float64 ones."""
        if n.op not in WIDENS or n.tensor.dtype != torch.float32:
            return False
        exprs = {k: e for k, e in args.items() if isinstance(e, Expr)}
        wide = {k: self.roundings[e] for k, e in exprs.items() if e in self.roundings}
        if not wide or any(e.dtype != torch.float32 for e in exprs.values()):
            return False
        for leaf in walk(list(exprs.values())):
            if leaf.args or leaf.op in ("acc", "const"):
                continue
            if leaf.op != "load" or leaf.value[1].variables() & inner:
                return False  # varies along the reduced dims: per-element arithmetic
        args.update(wide)
        return True
