"""The scalar formulas of the op table's pointwise rows (ir/ops.py) and the helpers they
share: each takes the op's schema arguments by name, tensors as scalar `Expr`s already cast
to the op's compute dtype, and returns its element in the primitives of `scalar.py`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .index import linearize
from .scalar import Expr, call, cast, const, fma, position, where


# -- scalar helpers -------------------------------------------------------------
def exp(x: Expr) -> Expr:
    return call("exp", x)


def tanh(x: Expr) -> Expr:
    return call("tanh", x)


def maximum(a: Any, b: Any) -> Expr:
    return call("max", a, b)


def minimum(a: Any, b: Any) -> Expr:
    return call("min", a, b)


def clamp(x: Expr, lo: Any = None, hi: Any = None) -> Expr:
    # torch applies min last: clamp(x, 3, 1) is 1; NaN propagates through both.
    if lo is not None:
        x = maximum(x, lo)
    if hi is not None:
        x = minimum(x, hi)
    return x


def eq(a: Any, b: Any) -> Expr:
    return call("eq", a, b)


def ne(a: Any, b: Any) -> Expr:
    return call("ne", a, b)


def truthy(x: Expr) -> Expr:
    return x if x.dtype == torch.bool else ne(x, 0)


SQRT1_2 = math.sqrt(0.5)
GELU_TANH_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
GELU_KAPPA = 0.044715
GELU_PDF = (2.0 / math.sqrt(math.pi)) * SQRT1_2 * 0.5


def gelu(self: Expr, approximate: str = "none") -> Expr:
    x = self
    if approximate == "tanh":
        return 0.5 * x * (1 + tanh(GELU_TANH_BETA * (x + GELU_KAPPA * (x * x * x))))
    return x * 0.5 * (1 + call("erf", x * SQRT1_2))


def gelu_backward(grad_output: Expr, self: Expr, approximate: str = "none") -> Expr:
    x = self
    if approximate == "tanh":
        x_sq = x * x
        inner = GELU_TANH_BETA * (x + GELU_KAPPA * x_sq * x)
        t = tanh(inner)
        left = 0.5 * x
        right = 1 + t
        left_d = 0.5 * right
        right_d = left * (1 - t * t) * GELU_TANH_BETA * (1 + 3 * GELU_KAPPA * x_sq)
        return grad_output * (left_d + right_d)
    cdf = 0.5 * (1 + call("erf", x * SQRT1_2))
    pdf = exp(-0.5 * x * x) * GELU_PDF
    return grad_output * (cdf + x * pdf)


def pow_scalar(self: Expr, exponent: float) -> Expr:
    # torch special-cases these exponents; matching it keeps results bit-identical.
    if exponent == 2:
        return self * self
    if exponent == 3:
        return self * self * self
    if exponent == 1:
        return self
    if exponent == 0:
        return const(1, self.dtype)
    if self.dtype.is_floating_point:
        if exponent == 0.5:
            return call("sqrt", self)
        if exponent == -0.5:
            return call("rsqrt", self)
        if exponent == -1:
            return call("reciprocal", self)
        if exponent == -2:
            return call("reciprocal", self * self)
    return call("pow", self, exponent)


def softplus(self: Expr, beta: float = 1, threshold: float = 20) -> Expr:
    z = self * beta
    return where(z > threshold, self, call("log1p", exp(z)) / beta)


def div_mode(self: Expr, other: Any, rounding_mode: str | None = None) -> Expr:
    if rounding_mode == "trunc":
        return call("truncdiv", self, other)
    if rounding_mode == "floor":
        return call("floordiv", self, other)
    return self / other


def round_decimals(self: Expr, decimals: int = 0) -> Expr:
    # torch's round_decimals: scaled by 10^|decimals| in the input's opmath dtype, rounded
    # half to even, scaled back (bit for bit, float16/32/64, decimals -2..5)
    if decimals == 0:
        return call("round", self)
    if decimals > 0:
        return call("round", self * 10.0**decimals) / 10.0**decimals
    return call("round", self / 10.0**-decimals) * 10.0**-decimals


def lerp(self: Expr, end: Any, weight: Any) -> Expr:
    # torch's two-sided form keeps lerp(a, b, 1) == b exactly, and its vector kernel rounds
    # each side once: fma(w, end - self, self) or fma(w - 1, end - self, end)
    small = call("abs", weight) < 0.5 if isinstance(weight, Expr) else abs(weight) < 0.5
    diff = end - self
    return where(small, fma(weight, diff, self), fma(weight - 1, diff, end))


def nan_to_num(self: Expr, nan: Any = None, posinf: Any = None, neginf: Any = None) -> Expr:
    if not self.dtype.is_floating_point:
        return self
    info = torch.finfo(self.dtype)
    x = where(eq(self, math.inf), info.max if posinf is None else posinf, self)
    x = where(eq(self, -math.inf), info.min if neginf is None else neginf, x)
    return where(call("isnan", self), 0.0 if nan is None else nan, x)


def elu(self: Expr, alpha: float = 1, scale: float = 1, input_scale: float = 1) -> Expr:
    return where(self <= 0, call("expm1", self * input_scale) * (alpha * scale), self * scale)


def elu_backward(
    grad_output: Expr,
    alpha: float,
    scale: float,
    input_scale: float,
    is_result: bool,
    self_or_result: Expr,
) -> Expr:
    x = self_or_result
    negcoef = alpha * scale
    if is_result:
        neg = grad_output * input_scale * (x + negcoef)
    else:
        neg = grad_output * input_scale * negcoef * exp(x * input_scale)
    # NaN takes the negative side, whose formula keeps it (eager's NaN, not grad * scale)
    return where(x > 0, grad_output * scale, neg)


def arange(start: Any, end: Any, step: Any = 1, *, _index: Any, **_: Any) -> Expr:
    pos = position(_index[0])
    return start + pos * step if step != 1 else start + pos


# Significand bits of each float dtype: uniform numbers with that many random bits convert
# to it exactly (rewrite/random.py computes the same in torch).
RANDOM_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def counter_rand(
    seed: Expr, size: Sequence[int], dtype: torch.dtype, offset: int, *, _index: Any
) -> Expr:
    """Element i of opfuse.rand: SplitMix64 of (seed, offset + i), its top bits scaled to
    [0, 1)."""
    z = call("mix64", seed, position(linearize(_index, size) + offset))
    bits = RANDOM_BITS[dtype]
    u = call("and", call("shr", z, 64 - bits), (1 << bits) - 1)
    return cast(u, torch.float64 if dtype == torch.float64 else torch.float32) * 2.0**-bits


def sub_alpha(self: Any, other: Any, alpha: Any = 1) -> Expr:
    return add_alpha(self, other, -alpha) if alpha != 1 else self - other


def add_alpha(self: Any, other: Any, alpha: Any = 1) -> Expr:
    if alpha == 1:
        return self + other
    # torch's kernels round self + alpha * other once (a fused multiply-add)
    return fma(other, alpha, self)
