"""The op table: one row per ATen op opfuse understands.

A row says what kind of op it is (the ordered `Kind`, TVM style: fusion rules compare kinds)
and, for pointwise ops, its scalar formula in terms of the primitives of `scalar.py`;
for views, how an index into the output maps to an index into the input; for reductions,
what they accumulate. Ops missing from the table are OPAQUE: they run with torch.

Formulas take the op's schema arguments by name. Tensor arguments arrive as scalar `Expr`s
already cast to the op's compute dtype (unless listed in `keep`); other arguments arrive as
the Python values the graph holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from .combine import Combine
from .graph import Node, bind
from .index import Ix, Var, delinearize, linearize
from .scalar import Expr, call, cast, const, fma, position, where


class Kind(IntEnum):
    """Ordered op kinds: a lower kind fuses into a higher one's group more freely."""

    ELEMENTWISE = 0  # same-shape pointwise
    BROADCAST = 1  # pointwise reading a broadcast operand
    INJECTIVE = 2  # views: every output element reads one input element
    REDUCTION = 3
    ANCHOR = 4  # matmul / convolution: a library call that takes an epilogue
    OPAQUE = 5  # anything else: runs with torch


@dataclass(frozen=True)
class Reduction:
    """What a reduction op accumulates.

    combine: how values fold (ir/combine.py's table)
    result: which value(s) it returns: 'value', 'mean', 'var', 'var_mean', 'value_index'
    """

    combine: Combine
    result: str = "value"


@dataclass(frozen=True)
class OpInfo:
    kind: Kind
    formula: Callable[..., Any] | None = None
    keep: tuple[str, ...] = ()  # tensor args not cast to the compute dtype
    positional: bool = False  # the formula reads its element's position (_index=)
    index: Callable[..., tuple[Ix, ...]] | None = None  # views: out index -> input index
    # views that are bijections: input index -> out index (out shape, then the op's args)
    forward: Callable[..., tuple[Ix, ...]] | None = None
    reduction: Reduction | None = None
    # cat, constant_pad_nd: (read, out index, args) -> the element, read from one of the
    # inputs (read(node, index) -> Expr) or a constant
    gather: Callable[..., Expr] | None = None
    copies: bool = False  # injective, but eager materialises it (flip, repeat, cat, pad)

    @property
    def pointwise(self) -> bool:
        return self.kind <= Kind.BROADCAST


# -- scalar helpers used by formulas -----------------------------------------
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


def _sub(self: Any, other: Any, alpha: Any = 1) -> Expr:
    return _add(self, other, -alpha) if alpha != 1 else self - other


def _add(self: Any, other: Any, alpha: Any = 1) -> Expr:
    if alpha == 1:
        return self + other
    # torch's kernels round self + alpha * other once (a fused multiply-add)
    return fma(other, alpha, self)


# -- index maps of views: output multi-index -> input multi-index -------------
def _shape(x: Any) -> tuple[int, ...]:
    return x.meta.shape


def _norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def ix_permute(out: Sequence[Ix], self: Any, dims: Sequence[int]) -> tuple[Ix, ...]:
    n = len(dims)
    inp = [Ix()] * n
    for k, d in enumerate(dims):
        inp[_norm_dim(d, n)] = out[k]
    return tuple(inp)


def ix_transpose(out: Sequence[Ix], self: Any, dim0: int, dim1: int) -> tuple[Ix, ...]:
    n = len(out)
    a, b = _norm_dim(dim0, n), _norm_dim(dim1, n)
    inp = list(out)
    inp[a], inp[b] = out[b], out[a]
    return tuple(inp)


def ix_t(out: Sequence[Ix], self: Any) -> tuple[Ix, ...]:
    return tuple(reversed(out)) if len(out) == 2 else tuple(out)


def ix_expand(
    out: Sequence[Ix], self: Any, size: Sequence[int], implicit: bool = False
) -> tuple[Ix, ...]:
    shape = _shape(self)
    lead = len(out) - len(shape)
    return tuple(Ix() if shape[d] == 1 else out[d + lead] for d in range(len(shape)))


def ix_unsqueeze(out: Sequence[Ix], self: Any, dim: int) -> tuple[Ix, ...]:
    d = _norm_dim(dim, len(out))
    return tuple(out[:d]) + tuple(out[d + 1 :])


def ix_squeeze(out: Sequence[Ix], self: Any, dim: Any = None) -> tuple[Ix, ...]:
    shape = _shape(self)
    if dim is None:
        dims = {d for d, s in enumerate(shape) if s == 1}
    else:
        ds = dim if isinstance(dim, (list, tuple)) else [dim]
        dims = {_norm_dim(d, len(shape)) for d in ds if shape[_norm_dim(d, len(shape))] == 1}
    it = iter(out)
    return tuple(Ix() if d in dims else next(it) for d in range(len(shape)))


def ix_slice(
    out: Sequence[Ix], self: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1
) -> tuple[Ix, ...]:
    shape = _shape(self)
    d = _norm_dim(dim, len(shape))
    begin = 0 if start is None else start
    if begin < 0:
        begin += shape[d]
    begin = min(max(begin, 0), shape[d])
    inp = list(out)
    inp[d] = out[d] * step + begin
    return tuple(inp)


def ix_select(out: Sequence[Ix], self: Any, dim: int, index: int) -> tuple[Ix, ...]:
    shape = _shape(self)
    d = _norm_dim(dim, len(shape))
    i = index + shape[d] if index < 0 else index
    return (*out[:d], Ix.of(i), *out[d:])


def ix_view(out: Sequence[Ix], self: Any, size: Sequence[int]) -> tuple[Ix, ...]:
    out_shape = [s for s in size]
    if -1 in out_shape:
        known = math.prod(s for s in out_shape if s != -1)
        out_shape[out_shape.index(-1)] = math.prod(_shape(self)) // max(known, 1)
    return delinearize(linearize(out, out_shape), _shape(self))


def ix_as_strided(
    out: Sequence[Ix],
    self: Any,
    size: Sequence[int],
    stride: Sequence[int],
    storage_offset: Any = None,
) -> tuple[Ix, ...]:
    """as_strided addresses storage; on a row-major (contiguous) input that storage order
    is its logical order, so the element offset delinearises into an input index."""
    m = self.meta
    if not m.is_contiguous():
        raise ValueError("as_strided of a non-contiguous value")
    flat = Ix.of((storage_offset if storage_offset is not None else m.offset) - m.offset)
    for i, st in zip(out, stride):
        flat = flat + i * st
    return delinearize(flat, m.shape)


def ix_unfold(out: Sequence[Ix], self: Any, dimension: int, size: int, step: int) -> tuple[Ix, ...]:
    """Tensor.unfold: windows of `size` every `step` along `dimension`, the position inside
    the window a new last dimension (pooling's windows)."""
    if not _shape(self):
        return ()  # a 0-d tensor unfolds into its one element
    d = _norm_dim(dimension, len(_shape(self)))
    inp = list(out[:-1])
    inp[d] = out[d] * step + out[-1]
    return tuple(inp)


def ix_identity(out: Sequence[Ix], self: Any, *args: Any, **kwargs: Any) -> tuple[Ix, ...]:
    return tuple(out)


# -- where a view that is a bijection puts each element: input index -> output index -----
def fw_reshape(
    inp: Sequence[Ix], out_shape: Sequence[int], self: Any, *args: Any, **kwargs: Any
) -> tuple[Ix, ...]:
    """view, reshape, squeeze, unsqueeze: the same row-major order in another shape."""
    return delinearize(linearize(inp, _shape(self)), out_shape)


def fw_permute(
    inp: Sequence[Ix], out_shape: Sequence[int], self: Any, dims: Sequence[int]
) -> tuple[Ix, ...]:
    return tuple(inp[_norm_dim(d, len(dims))] for d in dims)


def fw_transpose(
    inp: Sequence[Ix], out_shape: Sequence[int], self: Any, dim0: int, dim1: int
) -> tuple[Ix, ...]:
    return ix_transpose(inp, self, dim0, dim1)  # a swap undoes itself


def fw_t(inp: Sequence[Ix], out_shape: Sequence[int], self: Any) -> tuple[Ix, ...]:
    return ix_t(inp, self)


def fw_identity(
    inp: Sequence[Ix], out_shape: Sequence[int], self: Any, *args: Any, **kwargs: Any
) -> tuple[Ix, ...]:
    return tuple(inp)


def ix_flip(out: Sequence[Ix], self: Any, dims: Sequence[int]) -> tuple[Ix, ...]:
    shape = _shape(self)
    flipped = {_norm_dim(d, len(shape)) for d in dims}
    return tuple(shape[d] - 1 - i if d in flipped else i for d, i in enumerate(out))


def ix_repeat(out: Sequence[Ix], self: Any, repeats: Sequence[int]) -> tuple[Ix, ...]:
    shape = _shape(self)
    lead = len(out) - len(shape)
    return tuple(Ix() if s == 1 else out[d + lead] % s for d, s in enumerate(shape))


def ix_roll(
    out: Sequence[Ix], self: Any, shifts: Sequence[int], dims: Sequence[int] = ()
) -> tuple[Ix, ...]:
    shape = _shape(self)
    if not dims:  # the flattened tensor rolls
        n = math.prod(shape)
        flat = (linearize(out, shape) + (n - shifts[0] % n)) % n if n else Ix()
        return delinearize(flat, shape)
    idx = list(out)
    for s, d in zip(shifts, dims):
        d = _norm_dim(d, len(shape))
        idx[d] = (idx[d] + (shape[d] - s % shape[d])) % shape[d] if shape[d] else idx[d]
    return tuple(idx)


def ix_upsample_nearest(
    out: Sequence[Ix],
    self: Any,
    output_size: Sequence[int],
    scales_h: float | None = None,
    scales_w: float | None = None,
) -> tuple[Ix, ...]:
    """Nearest upsampling by a power of two k: input row dst // k. torch computes
    floor(dst * (1/k)) in float, exactly that when 1/k is a power of two; other sizes raise
    ValueError (torch's kernel computes them, and the reading kernel loads its result)."""
    shape = _shape(self)
    idx = list(out)
    for j, (size, scale) in enumerate(zip(output_size, (scales_h, scales_w))):
        d = len(shape) - 2 + j
        k, rest = divmod(size, shape[d])
        if rest or k & (k - 1) or (scale is not None and scale != k):
            raise ValueError(f"nearest upsampling {shape[d]} -> {size} is not by a power of two")
        idx[d] = out[d] // k
    return tuple(idx)


# -- gathers: each output element is one element of one of the inputs, or a constant --------
Read = Callable[[Any, tuple[Ix, ...]], Expr]


def _wrapped(i: Ix, start: int, size: int) -> Ix:
    """i - start where that lies in [0, size); elsewhere the nearest index inside, so the
    element a `where` discards is read from memory the tensor owns, and from a row that
    stays in cache (C evaluates both sides of the `where`)."""
    return (i - start).clamp(size - 1)


def gather_cat(read: Read, out: tuple[Ix, ...], tensors: Sequence[Any], dim: int = 0) -> Expr:
    # torch skips legacy empty 1-D inputs ([0]) whatever the rank of the others
    parts = [t for t in tensors if t.meta.numel > 0]
    d = _norm_dim(dim, len(out))
    pos = position(out[d])
    result: Expr | None = None
    starts = [0]
    for t in parts[:-1]:
        starts.append(starts[-1] + t.meta.shape[d])
    for t, start in reversed(list(zip(parts, starts))):
        size = t.meta.shape[d]
        v = read(t, (*out[:d], _wrapped(out[d], start, size), *out[d + 1 :]))
        result = v if result is None else where(pos < start + size, v, result)
    assert result is not None, "cat of empty tensors only"
    return result


def gather_pad(
    read: Read, out: tuple[Ix, ...], self: Any, pad: Sequence[int], value: Any = 0
) -> Expr:
    shape = _shape(self)
    fill = const(value, self.meta.dtype)
    if self.meta.numel == 0:
        return fill
    idx = list(out)
    tests: list[Expr] = []
    for j in range(len(pad) // 2):
        d = len(shape) - 1 - j
        lo, hi = pad[2 * j], pad[2 * j + 1]
        idx[d] = _wrapped(out[d], lo, shape[d])
        tests += [position(out[d]) >= lo] if lo > 0 else []
        tests += [position(out[d]) < lo + shape[d]] if hi > 0 else []
    v = read(self, tuple(idx))
    return v if not tests else where(_all(tests), v, fill)


def _all(tests: Sequence[Expr]) -> Expr:
    """The conjunction of position tests (at least one)."""
    inside = tests[0]
    for t in tests[1:]:
        inside = call("and", inside, t)
    return inside


def slice_bounds(start: int | None, end: int | None, size: int) -> tuple[int, int]:
    """[start, end) of a slice of `size` elements, as torch clamps it."""
    lo = 0 if start is None else start + size if start < 0 else start
    hi = size if end is None else end + size if end < 0 else end
    lo = min(max(lo, 0), size)
    return lo, min(max(hi, lo), size)


def gather_slice_scatter(
    read: Read,
    out: tuple[Ix, ...],
    self: Any,
    src: Any,
    dim: int = 0,
    start: int | None = None,
    end: int | None = None,
    step: int = 1,
) -> Expr:
    """`self` with slice [start:end:step] of `dim` replaced by `src`: what an in-place write
    to a slice becomes once functionalised, and the gradient of a slice (into zeros)."""
    d = _norm_dim(dim, len(out))
    lo, hi = slice_bounds(start, end, _shape(self)[d])
    n = _shape(src)[d]
    if n == 0:
        return read(self, out)
    i = out[d]
    pos = position(i)
    tests = ([pos >= lo] if lo > 0 else []) + ([pos < hi] if hi < _shape(self)[d] else [])
    if step == 1:
        at = _wrapped(i, lo, n)
    else:
        # i - lo, shifted by whole steps to stay >= 0 (C's / and % truncate negatives)
        k = -(-lo // step)
        shifted = i + (k * step - lo)
        tests.append(call("eq", position(shifted % step), 0))
        at = (shifted // step - k).clamp(n - 1)
    v = read(src, (*out[:d], at, *out[d + 1 :]))
    return v if not tests else where(_all(tests), v, read(self, out))


# -- the table -----------------------------------------------------------------
E = Kind.ELEMENTWISE  # BROADCAST is decided per node, from shapes (fusion/classify.py)


def pw(formula: Callable[..., Any], keep: tuple[str, ...] = ()) -> OpInfo:
    return OpInfo(E, formula, keep)


def view(
    index: Callable[..., tuple[Ix, ...]], forward: Callable[..., tuple[Ix, ...]] | None = None
) -> OpInfo:
    return OpInfo(Kind.INJECTIVE, index=index, forward=forward)


def copy_view(index: Callable[..., tuple[Ix, ...]]) -> OpInfo:
    return OpInfo(Kind.INJECTIVE, index=index, copies=True)


def gather(fn: Callable[..., Expr]) -> OpInfo:
    return OpInfo(Kind.INJECTIVE, gather=fn, copies=True)


def red(combine: str, result: str = "value") -> OpInfo:
    return OpInfo(Kind.REDUCTION, reduction=Reduction(Combine(combine), result))


def _u(prim: str) -> OpInfo:
    return pw(lambda self: call(prim, self))


OPAQUE = OpInfo(Kind.OPAQUE)
ANCHOR = OpInfo(Kind.ANCHOR)

# fmt: off
OPS: dict[str, OpInfo] = {
    # arithmetic
    "aten.add.Tensor": pw(_add),
    "aten.add.Scalar": pw(_add),
    "aten.sub.Tensor": pw(_sub),
    "aten.sub.Scalar": pw(_sub),
    "aten.rsub.Scalar": pw(lambda self, other, alpha=1: _sub(other, self, alpha)),
    "aten.rsub.Tensor": pw(lambda self, other, alpha=1: _sub(other, self, alpha)),
    "aten.mul.Tensor": pw(lambda self, other: self * other),
    "aten.mul.Scalar": pw(lambda self, other: self * other),
    "aten.div.Tensor": pw(lambda self, other: self / other),
    "aten.div.Scalar": pw(lambda self, other: self / other),
    "aten.div.Tensor_mode": pw(div_mode),
    "aten.div.Scalar_mode": pw(div_mode),
    "aten.true_divide.Tensor": pw(lambda self, other: self / other),
    "aten.floor_divide.default": pw(lambda self, other: call("floordiv", self, other)),
    "aten.floor_divide.Scalar": pw(lambda self, other: call("floordiv", self, other)),
    "aten.fmod.Tensor": pw(lambda self, other: call("fmod", self, other)),
    "aten.fmod.Scalar": pw(lambda self, other: call("fmod", self, other)),
    "aten.remainder.Tensor": pw(lambda self, other: call("remainder", self, other)),
    "aten.remainder.Scalar": pw(lambda self, other: call("remainder", self, other)),
    "aten.pow.Tensor_Scalar": pw(pow_scalar),
    "aten.pow.Tensor_Tensor": pw(lambda self, exponent: call("pow", self, exponent)),
    "aten.pow.Scalar": pw(lambda self, exponent: call("pow", self, exponent)),
    "aten.neg.default": pw(lambda self: -self),
    "aten.abs.default": _u("abs"),
    "aten.sign.default": _u("sign"),
    "aten.sgn.default": _u("sign"),
    "aten.reciprocal.default": _u("reciprocal"),
    "aten.square.default": pw(lambda self: self * self),
    "aten.maximum.default": pw(lambda self, other: maximum(self, other)),
    "aten.minimum.default": pw(lambda self, other: minimum(self, other)),
    "aten.fmax.default": pw(lambda self, other: call("fmax", self, other)),
    "aten.fmin.default": pw(lambda self, other: call("fmin", self, other)),
    "aten.atan2.default": pw(lambda self, other: call("atan2", self, other)),
    "aten.copysign.Tensor": pw(lambda self, other: call("copysign", self, other)),
    "aten.hypot.default": pw(lambda self, other: call("hypot", self, other)),
    "aten.addcmul.default": pw(lambda self, tensor1, tensor2, value=1: self + value * tensor1 * tensor2
                               if value != 1 else self + tensor1 * tensor2),
    "aten.addcdiv.default": pw(lambda self, tensor1, tensor2, value=1: self + value * tensor1 / tensor2
                               if value != 1 else self + tensor1 / tensor2),
    "aten.lerp.Scalar": pw(lerp),
    "aten.lerp.Tensor": pw(lerp),
    "aten.frac.default": pw(lambda self: self - call("trunc", self)),
    # math
    **{f"aten.{p}.default": _u(p) for p in (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos",
        "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
        "sigmoid", "erf", "erfc", "floor", "ceil", "trunc", "round", "lgamma")},
    # activations
    "aten.relu.default": pw(lambda self: maximum(self, 0)),
    "aten.gelu.default": pw(gelu),
    "aten.silu.default": pw(lambda self: self * call("sigmoid", self)),
    "aten.mish.default": pw(lambda self: self * tanh(softplus(self))),
    "aten.hardswish.default": pw(lambda self: self * clamp(self + 3, 0, 6) / 6),
    "aten.hardsigmoid.default": pw(lambda self: clamp(self + 3, 0, 6) / 6),
    "aten.hardtanh.default": pw(lambda self, min_val=-1, max_val=1: clamp(self, min_val, max_val)),
    "aten.clamp.default": pw(lambda self, min=None, max=None: clamp(self, min, max)),
    "aten.clamp.Tensor": pw(lambda self, min=None, max=None: clamp(self, min, max)),
    "aten.clamp_min.default": pw(lambda self, min: maximum(self, min)),
    "aten.clamp_max.default": pw(lambda self, max: minimum(self, max)),
    "aten.leaky_relu.default": pw(lambda self, negative_slope=0.01:
                                  where(self > 0, self, self * negative_slope)),
    "aten.elu.default": pw(elu),
    "aten.softplus.default": pw(softplus),
    "aten.nan_to_num.default": pw(nan_to_num),
    # comparisons, predicates, logic
    **{f"aten.{p}.{o}": pw(lambda self, other, _p=p: call(_p, self, other))
       for p in ("eq", "ne", "lt", "le", "gt", "ge") for o in ("Tensor", "Scalar")},
    "aten.isnan.default": _u("isnan"),
    "aten.isinf.default": _u("isinf"),
    "aten.isfinite.default": pw(lambda self: ~(call("isnan", self) | call("isinf", self))
                                if self.dtype.is_floating_point else eq(self, self)),
    "aten.signbit.default": _u("signbit"),
    "aten.logical_not.default": pw(lambda self: eq(self, 0), keep=("self",)),
    "aten.logical_and.default": pw(lambda self, other: truthy(self) & truthy(other),
                                   keep=("self", "other")),
    "aten.logical_or.default": pw(lambda self, other: truthy(self) | truthy(other),
                                  keep=("self", "other")),
    "aten.logical_xor.default": pw(lambda self, other: truthy(self) ^ truthy(other),
                                   keep=("self", "other")),
    "aten.bitwise_and.Tensor": pw(lambda self, other: self & other),
    "aten.bitwise_and.Scalar": pw(lambda self, other: self & other),
    "aten.bitwise_or.Tensor": pw(lambda self, other: self | other),
    "aten.bitwise_or.Scalar": pw(lambda self, other: self | other),
    "aten.bitwise_xor.Tensor": pw(lambda self, other: self ^ other),
    "aten.bitwise_xor.Scalar": pw(lambda self, other: self ^ other),
    "aten.bitwise_not.default": pw(lambda self: ~self),
    # selection, conversion, creation
    "aten.where.self": pw(lambda condition, self, other: where(condition, self, other),
                          keep=("condition",)),
    "aten.where.ScalarSelf": pw(lambda condition, self, other: where(condition, self, other),
                                keep=("condition",)),
    "aten.where.ScalarOther": pw(lambda condition, self, other: where(condition, self, other),
                                 keep=("condition",)),
    "aten.masked_fill.Scalar": pw(lambda self, mask, value: where(mask, value, self), keep=("mask",)),
    "aten.masked_fill.Tensor": pw(lambda self, mask, value: where(mask, value, self), keep=("mask",)),
    "aten._to_copy.default": pw(lambda self, **_: self, keep=("self",)),
    "aten.clone.default": pw(lambda self, **_: self, keep=("self",)),
    "aten.copy.default": pw(lambda self, src, non_blocking=False: src, keep=("self", "src")),
    "aten.lift_fresh_copy.default": pw(lambda self: self, keep=("self",)),
    "prims.convert_element_type.default": pw(lambda a, dtype: a, keep=("a",)),
    "prims.copy_strided.default": pw(lambda a, stride: a, keep=("a",)),  # layout change only
    "aten.scalar_tensor.default": pw(lambda s, **_: s),
    "aten.full.default": pw(lambda size, fill_value, **_: fill_value),
    "aten.full_like.default": pw(lambda self, fill_value, **_: fill_value, keep=("self",)),
    "aten.zeros_like.default": pw(lambda self, **_: 0, keep=("self",)),
    "aten.ones_like.default": pw(lambda self, **_: 1, keep=("self",)),
    "aten.fill.Scalar": pw(lambda self, value: value, keep=("self",)),
    "aten.arange.start_step": OpInfo(E, arange, positional=True),
    "aten.arange.start": OpInfo(E, arange, positional=True),
    "aten.arange.default": OpInfo(E, lambda end, _index, **kw: arange(0, end, 1, _index=_index),
                                  positional=True),
    # backward pointwise ops (AOTAutograd)
    "aten.threshold_backward.default": pw(lambda grad_output, self, threshold:
                                          where(self <= threshold, 0, grad_output)),
    "aten.sigmoid_backward.default": pw(lambda grad_output, output:
                                        grad_output * (1 - output) * output),
    "aten.tanh_backward.default": pw(lambda grad_output, output:
                                     grad_output * (1 - output * output)),
    "aten.gelu_backward.default": pw(gelu_backward),
    "aten.silu_backward.default": pw(lambda grad_output, self: grad_output * call("sigmoid", self)
                                     * (1 + self * (1 - call("sigmoid", self)))),
    # NaN inputs: the gradient eager computes in float64 (hardswish: NaN; hardtanh: 0)
    "aten.hardswish_backward.default": pw(lambda grad_output, self: where(
        self < -3, 0, where(self > 3, grad_output, grad_output * (self / 3 + 0.5)))),
    "aten.hardsigmoid_backward.default": pw(lambda grad_output, self: where(
        (self > -3) & (self < 3), grad_output / 6, 0)),
    "aten.hardtanh_backward.default": pw(lambda grad_output, self, min_val, max_val: where(
        (self > min_val) & (self < max_val), grad_output, 0)),
    "aten.leaky_relu_backward.default": pw(
        lambda grad_output, self, negative_slope, self_is_result:
        where(self > 0, grad_output, grad_output * negative_slope)),
    "aten.elu_backward.default": pw(elu_backward),
    "aten.softplus_backward.default": pw(lambda grad_output, self, beta, threshold: where(
        self * beta > threshold, grad_output,
        grad_output * exp(self * beta) / (exp(self * beta) + 1))),
    # rewrite/random.py's uniform numbers, computed where they are used
    "opfuse.rand.default": OpInfo(E, counter_rand, keep=("seed",), positional=True),
    # views: no data moves; fused groups read through their index maps
    "aten.view.default": view(ix_view, fw_reshape),
    "aten._unsafe_view.default": view(ix_view, fw_reshape),
    "aten.reshape.default": view(ix_view, fw_reshape),
    "aten.permute.default": view(ix_permute, fw_permute),
    "aten.transpose.int": view(ix_transpose, fw_transpose),
    "aten.t.default": view(ix_t, fw_t),
    "aten.expand.default": view(ix_expand),
    "aten.unsqueeze.default": view(ix_unsqueeze, fw_reshape),
    "aten.squeeze.dim": view(ix_squeeze, fw_reshape),
    "aten.squeeze.dims": view(ix_squeeze, fw_reshape),
    "aten.squeeze.default": view(ix_squeeze, fw_reshape),
    "aten.slice.Tensor": view(ix_slice),
    "aten.select.int": view(ix_select),
    "aten.alias.default": view(ix_identity, fw_identity),
    "aten.detach.default": view(ix_identity, fw_identity),
    "aten.as_strided.default": view(ix_as_strided),
    "aten.unfold.default": view(ix_unfold),
    # data movement eager copies; fused kernels read through it like a view
    "aten.flip.default": copy_view(ix_flip),
    "aten.repeat.default": copy_view(ix_repeat),
    "aten.roll.default": copy_view(ix_roll),
    "aten.upsample_nearest2d.default": copy_view(ix_upsample_nearest),
    "aten.cat.default": gather(gather_cat),
    "aten.constant_pad_nd.default": gather(gather_pad),
    "aten.slice_scatter.default": gather(gather_slice_scatter),
    "getitem": OpInfo(Kind.INJECTIVE),
    # reductions
    "aten.sum.dim_IntList": red("sum"),
    "aten.sum.default": red("sum"),
    "aten.mean.dim": red("sum", "mean"),
    "aten.mean.default": red("sum", "mean"),
    "aten.prod.dim_int": red("prod"),
    "aten.prod.default": red("prod"),
    "aten.amax.default": red("max"),
    "aten.amin.default": red("min"),
    "aten.max.default": red("max"),
    "aten.min.default": red("min"),
    "aten.max.dim": red("argmax", "value_index"),
    "aten.min.dim": red("argmin", "value_index"),
    "aten.argmax.default": red("argmax", "index"),
    "aten.argmin.default": red("argmin", "index"),
    "aten.var.correction": red("welford", "var"),
    "aten.var_mean.correction": red("welford", "var_mean"),
    "aten.any.default": red("any"),
    "aten.any.dim": red("any"),
    "aten.any.dims": red("any"),
    "aten.all.default": red("all"),
    "aten.all.dim": red("all"),
    # anchors: library calls that take a fused epilogue
    "aten.mm.default": ANCHOR,
    "aten.addmm.default": ANCHOR,
    "aten.bmm.default": ANCHOR,
    "aten.baddbmm.default": ANCHOR,
    "aten.convolution.default": ANCHOR,
    # a depthwise (or few-channel) convolution's NHWC output as rows (rewrite/conv_rows.py)
    "opfuse.depthwise_rows.default": ANCHOR,
    "opfuse.conv_rows.default": ANCHOR,
}
# fmt: on

# Ops whose result is a view of their input (they never launch a kernel).
VIEW_OPS = frozenset(k for k, v in OPS.items() if v.kind == Kind.INJECTIVE and not v.copies)


# The fused attention call rewrite/attention.py makes (the op: ir/attention.py): a library
# call of its own pattern.
ATTENTION = "opfuse.attention.default"
# rewrite/random.py's per-call seed: a torch call the kernels computing opfuse.rand read.
SEED = "opfuse.seed.default"


# A kernel reading through a cat evaluates every input at every position (the `where`
# keeps one): beyond this many loads per element (inputs, nested gathers adding up)
# torch's copy is cheaper (DenseNet's growing cats). Along the contiguous dimension a
# pointwise kernel cuts its vector loop at the gather's boundaries (lower/split.py) and
# each piece reads one input: such a gather costs its most expensive input.
MAX_GATHER_INPUTS = 8


def reads_through(n: Any) -> bool:
    """Is `n` a gather (cat, constant_pad_nd) that kernels compute where they read it?"""
    return _loads(n) is not None


def _loads(n: Any) -> int | None:
    """The loads a kernel reading through gather `n` makes per element; None when it is not
    read through. Nested gathers add up (a 3-d circular pad's cats of three along the outer
    dimensions: 9 per element)."""
    row = info(n.op)
    if row.gather is None or len(n.inputs()) > MAX_GATHER_INPUTS:
        return None
    m = n.meta
    inner = [d for d in range(len(m.shape)) if m.stride[d] == 1 and m.shape[d] > 1]
    if not inner:
        along: set[int] = set()
    elif n.op in ("aten.cat.default", "aten.slice_scatter.default"):
        along = {_norm_dim(bind(n).get("dim", 0), len(m.shape))}
    else:
        along = {len(m.shape) - 1 - j // 2 for j, p in enumerate(bind(n)["pad"]) if p != 0}
    loads = []
    for i in n.inputs():
        while info(i.op).index is not None and isinstance(i.args[0], Node):
            i = i.args[0]  # views and index maps: the same loads as their source
        loads.append(_loads(i) or 1)
    split = inner and along == {inner[0]}
    total = max(loads) if split else sum(loads)
    return total if total <= MAX_GATHER_INPUTS else None


def computed_where_read(n: Any) -> bool:
    """Can a kernel compute copy `n` where it reads it: a gather within the load limit, or
    an index map that applies to n's arguments (nearest upsampling by 2, not by 3)?"""
    row = info(n.op)
    if row.gather is not None:
        return reads_through(n)
    if row.index is None:
        return False
    out = tuple(Ix.var(Var(f"i{d}", size)) for d, size in enumerate(n.meta.shape))
    try:
        row.index(out, *n.args, **n.kw)
    except ValueError:
        return False
    return True


# Ops torch runs whole by choice (capture keeps them from decomposing), by name prefix
# (leading underscores dropped), with what their decomposition measured: the report's
# reason for each such group.
TORCH_KERNELS = {
    "upsample": "torch's upsampling kernel (decomposed: gathers with index tensors, 2-50x slower)",
    "reflection_pad": "torch's padding kernel (decomposed: index gathers, 20-30x slower)",
    "replication_pad": "torch's padding kernel (decomposed: index gathers, 20-30x slower)",
    "im2col": "torch's unfold kernel (decomposed: index gathers, 3-4x slower)",
    "col2im": "torch's fold kernel (decomposed: index gathers, 3-4x slower)",
    "scaled_dot_product_flash_attention": "torch's flash attention kernel (decomposed: 0.73-0.91x)",
    "gru": "torch's recurrent layer (decomposed: a dozen ops per time step)",
    "rnn_": "torch's recurrent layer (decomposed: a dozen ops per time step)",
    "mkldnn_rnn_layer": "oneDNN's fused LSTM layer, as eager runs it",
}


# Torch ops outside the fused table whose result depends on their inputs alone (index
# gathers): on frozen constants their value is a constant, computed once at compile time
# (Swin's relative position bias table[index] ran as a gather on every call).
CONSTANT_FOLDABLE = frozenset(
    {
        "aten.index.Tensor",
        "aten.index_select.default",
        "aten.gather.default",
        "aten.embedding.default",
        "aten.take.default",
    }
)


def torch_kernel_reason(op: str) -> str | None:
    """Why torch runs `op` whole, if it is one of the ops kept from decomposing."""
    name = short(op).lstrip("_")
    return next((why for p, why in TORCH_KERNELS.items() if name.startswith(p)), None)


def short(op: str) -> str:
    """'aten.add.Tensor' -> 'add'; names without a namespace ('getitem', higher-order ops
    such as 'run_and_save_rng_state') as they are."""
    return op.split(".")[1] if "." in op else op


def info(op: str) -> OpInfo:
    return OPS.get(op, OPAQUE)


def is_generator(node: Any) -> bool:
    """A pointwise op that reads no tensor (full, scalar_tensor): free to recompute, so
    every kernel that reads it computes it inline instead of loading it."""
    return info(node.op).pointwise and not node.inputs()


def cast_args_for(op: str) -> Callable[[str], bool]:
    keep = info(op).keep
    return lambda name: name not in keep


__all__ = ["OPS", "VIEW_OPS", "Kind", "OpInfo", "Reduction", "cast", "info", "short"]


def reduce_dims(n: Node) -> tuple[tuple[int, ...], bool]:
    """The dims a reduction node reduces (sorted, non-negative) and its keepdim flag."""
    a = bind(n)
    src = a["self"].meta
    rank = len(src.shape)
    dim = a.get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        dims = tuple(range(rank))
    elif isinstance(dim, int):
        dims = (dim,)
    else:
        dims = tuple(dim)
    norm = tuple(sorted({d + rank if d < 0 else d for d in dims})) if rank else ()
    return norm, bool(a.get("keepdim", False))


def reduction_domain(n: Node) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape of the reduced input, dims it reduces): the loop nest a reduction runs."""
    return bind(n)["self"].tensor.shape, reduce_dims(n)[0]


def mismatched_reductions(reductions: Sequence[Node]) -> str | None:
    """Why these reductions (in topological order) cannot share one loop nest, or None:
    each must reduce the same dims of the same shape as the first."""
    if not reductions:
        return None
    first = reductions[0]
    shape, dims = reduction_domain(first)
    for r in reductions[1:]:
        s2, d2 = reduction_domain(r)
        if s2 != shape or d2 != dims:
            return (
                f"{r.name} reduces dims {list(d2)} of {list(s2)}, "
                f"{first.name} reduces dims {list(dims)} of {list(shape)}"
            )
    return None
