"""The index maps of the op table's view and gather rows (ir/ops.py): for a view, the
input index an output index reads (and, for a bijection, the output index an input index
lands at); for a gather (cat, pad, slice_scatter), the element each output index takes from
one of the inputs or a constant."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from .index import Ix, delinearize, linearize
from .scalar import Expr, call, const, position, where


# -- index maps of views: output multi-index -> input multi-index -------------
def _shape(x: Any) -> tuple[int, ...]:
    return x.meta.shape


def norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def ix_permute(out: Sequence[Ix], self: Any, dims: Sequence[int]) -> tuple[Ix, ...]:
    n = len(dims)
    inp = [Ix()] * n
    for k, d in enumerate(dims):
        inp[norm_dim(d, n)] = out[k]
    return tuple(inp)


def ix_transpose(out: Sequence[Ix], self: Any, dim0: int, dim1: int) -> tuple[Ix, ...]:
    n = len(out)
    a, b = norm_dim(dim0, n), norm_dim(dim1, n)
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
    d = norm_dim(dim, len(out))
    return tuple(out[:d]) + tuple(out[d + 1 :])


def ix_squeeze(out: Sequence[Ix], self: Any, dim: Any = None) -> tuple[Ix, ...]:
    shape = _shape(self)
    if dim is None:
        dims = {d for d, s in enumerate(shape) if s == 1}
    else:
        ds = dim if isinstance(dim, (list, tuple)) else [dim]
        dims = {norm_dim(d, len(shape)) for d in ds if shape[norm_dim(d, len(shape))] == 1}
    it = iter(out)
    return tuple(Ix() if d in dims else next(it) for d in range(len(shape)))


def ix_slice(
    out: Sequence[Ix], self: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1
) -> tuple[Ix, ...]:
    shape = _shape(self)
    d = norm_dim(dim, len(shape))
    begin = 0 if start is None else start
    if begin < 0:
        begin += shape[d]
    begin = min(max(begin, 0), shape[d])
    inp = list(out)
    inp[d] = out[d] * step + begin
    return tuple(inp)


def ix_select(out: Sequence[Ix], self: Any, dim: int, index: int) -> tuple[Ix, ...]:
    shape = _shape(self)
    d = norm_dim(dim, len(shape))
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
    d = norm_dim(dimension, len(_shape(self)))
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
    return tuple(inp[norm_dim(d, len(dims))] for d in dims)


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
    flipped = {norm_dim(d, len(shape)) for d in dims}
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
        d = norm_dim(d, len(shape))
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
    d = norm_dim(dim, len(out))
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
    d = norm_dim(dim, len(out))
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
