"""Pooling as window reductions: max and average pooling (and adaptive pools whose windows
tile the input evenly) become pad -> unfold along each pooled dimension -> amax / sum over
the window dimensions. The pad and the unfolds are read through, so a pool is one reduction
kernel that can take in the pointwise ops around it; torch's max pooling also writes int64
indices nobody reads in inference (and its NCHW kernels are 3-4x slower than a window
reduction: 8x64x112x112 3x3/2, 28 ms against 7-9 ms).

Max pooling is rewritten only where its indices are unused (training saves them for the
backward: torch keeps it). Average pooling divides by what torch divides by: the window's
size, its size inside the padding bounds (ceil mode's last windows) or its count of real
elements (count_include_pad=False), per output position when they differ.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ir.graph import GETITEM, Graph, GraphBuilder, Node, TensorMeta, bind
from .layout import is_channels_last

# op -> (kind, pooled dims)
POOLS: dict[str, tuple[str, int]] = {
    "aten.max_pool2d_with_indices.default": ("max", 2),
    "aten.max_pool3d_with_indices.default": ("max", 3),
    "aten.avg_pool2d.default": ("avg", 2),
    "aten.avg_pool3d.default": ("avg", 3),
    "aten._adaptive_avg_pool2d.default": ("avg", 2),
    "aten._adaptive_avg_pool3d.default": ("avg", 3),
    "aten.adaptive_max_pool2d.default": ("max", 2),
    "aten.adaptive_max_pool3d.default": ("max", 3),
}
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# Max pooling over overlapping windows runs one pass per dimension where that reads
# SEPARABLE times fewer elements (9x9 and wider; not 3x3x3, whose passes' intermediates
# cost more than they save; never a global or other non-overlapping pool, which reads
# every element once anyway).
SEPARABLE = 4


@dataclass(frozen=True)
class Window:
    """One pooled dimension: window size, step, padding before, dilation."""

    size: int
    stride: int
    pad: int
    dilation: int = 1

    @property
    def span(self) -> int:
        return self.dilation * (self.size - 1) + 1


def pools_in_kernels(graph: Graph, devices: Sequence[str] = ("cpu",)) -> tuple[Graph, list[str]]:
    """`graph` with every pool kernels can compute as a window reduction rewritten; one
    line per rewritten pool for the report."""
    users = graph.users
    b = GraphBuilder().copy_from(graph)
    notes: list[str] = []
    replaced: set[Node] = set()
    for n in graph.nodes:
        if n in replaced:
            continue
        out = _rewrite(b, n, users, devices)
        if out is None:
            b.copy(n)
            continue
        new, result = out
        if isinstance(n.meta, tuple):  # (values, indices): the values' getitems read `new`
            for u in users[n]:
                b.replace(u, new)
                replaced.add(u)
        else:
            b.replace(n, new)
        where = f" ({n.source.module})" if n.source is not None and n.source.module else ""
        notes.append(f"{n.name}{where}: {result}")
    return b.build(graph.outputs), notes


def _rewrite(
    b: GraphBuilder, n: Node, users: Mapping[Node, Sequence[Node]], devices: Sequence[str]
) -> tuple[Node, str] | None:
    if n.op not in POOLS:
        return None
    kind, dims = POOLS[n.op]
    x = n.args[0]
    if not isinstance(x, Node) or not isinstance(x.meta, TensorMeta):
        return None
    xm = x.meta
    values = n.meta[0] if isinstance(n.meta, tuple) else n.meta
    if not isinstance(values, TensorMeta) or values.numel == 0 or xm.numel == 0:
        return None
    if not xm.dtype.is_floating_point or xm.device_type not in devices:
        return None
    if isinstance(n.meta, tuple) and not all(u.op == GETITEM and u.args[1] == 0 for u in users[n]):
        return None  # the indices are read (a backward): torch computes them
    a = bind(n)
    windows = _windows(n.op, a, xm.shape[-dims:], values.shape[-dims:], dims)
    if windows is None:
        return None
    # max(f(x)) = f(max(x)) for a non-decreasing f, where every window holds an element
    # of x (dilation 1: a window starts before the input's end and ends after its start):
    # f then runs once per output, not once per window element (ResNet's ReLU before its
    # 3x3/2 max pool: 9 times per output, with a NaN-keeping max each)
    after = x if kind == "max" and _monotone(x, users, windows) else None
    src = x.args[0] if after is not None else x
    assert isinstance(src, Node)
    new = _window_reduction(b, b.get(src), values, kind, windows, a, n)
    if new is None:
        return None
    if after is not None:
        new = b.call(after.target, new, *after.args[1:], **dict(after.kwargs), source=after.source)
    sizes = "x".join(str(w.size) for w in windows)
    strides = "x".join(str(w.stride) for w in windows)
    op = "amax" if kind == "max" else "mean"
    moved = f", its {after.op.split('.')[1]} applied after" if after is not None else ""
    return new, f"{op} over {sizes} windows, stride {strides}, as a reduction kernel{moved}"


# pointwise ops that never decrease as their input grows (and keep NaN)
_MONOTONE = ("aten.relu.default", "aten.hardtanh.default", "aten.clamp.default")


def _monotone(x: Node, users: Mapping[Node, Sequence[Node]], windows: Sequence[Window]) -> bool:
    """May the max pool over x take x's op after it? x is a non-decreasing op of a tensor
    of its own dtype, read by nothing else, and every window holds an element of it."""
    src = x.args[0] if x.args else None
    return (
        x.op in _MONOTONE
        and len(users[x]) == 1
        and isinstance(src, Node)
        and isinstance(src.meta, TensorMeta)
        and src.meta == x.meta
        and all(w.dilation == 1 and w.pad < w.size for w in windows)
    )


def _windows(
    op: str, a: dict[str, Any], ins: Sequence[int], outs: Sequence[int], dims: int
) -> list[Window] | None:
    if "adaptive" in op:
        # Adaptive windows are all alike only where each output cell covers a whole
        # number of input cells.
        if any(o == 0 or i % o for i, o in zip(ins, outs)):
            return None
        return [Window(i // o, i // o, 0) for i, o in zip(ins, outs)]

    def per_dim(v: Any, default: Sequence[int] | None = None) -> list[int]:
        if v is None or (isinstance(v, (list, tuple)) and not v):
            assert default is not None
            return list(default)
        vs = [v] if isinstance(v, int) else list(v)
        return vs * dims if len(vs) == 1 else vs

    k = per_dim(a["kernel_size"])
    s = per_dim(a.get("stride"), k)
    p = per_dim(a.get("padding", 0))
    d = per_dim(a.get("dilation", 1))
    if not all(len(v) == dims for v in (k, s, p, d)):
        return None
    windows = [Window(*w) for w in zip(k, s, p, d)]
    for w, i, o in zip(windows, ins, outs):
        # the output size torch computed, from windows that start inside input + padding
        if (o - 1) * w.stride >= i + w.pad or w.size < 1 or w.stride < 1:
            return None
    return windows


def _window_reduction(
    b: GraphBuilder,
    x: Node,
    values: TensorMeta,
    kind: str,
    windows: Sequence[Window],
    a: dict[str, Any],
    n: Node,
) -> Node | None:
    aten = torch.ops.aten
    xm = x.tensor
    dims = len(windows)
    nd = xm.ndim
    src = n.source
    nodes_before = len(b.nodes)
    ins = xm.shape[-dims:]
    outs = values.shape[-dims:]
    pooled = [(nd - dims + j, w, o) for j, (w, o) in enumerate(zip(windows, outs))]
    sizes = [w.size for w in windows]
    overlap = all(w.stride < w.size for w in windows)  # else every element is read once
    if kind == "max" and overlap and math.prod(sizes) > SEPARABLE * sum(sizes):
        # The maximum over a k x k window is the maximum over k rows of the maxima over k
        # columns: one pass per dimension reads 2k elements per output instead of k*k
        # (SPP's 13 x 13 pooling, 8x256x20x20 NCHW: 62 -> 8 ms).
        v = x
        for i, p in enumerate(pooled):
            v = _reduce(b, v, [p], kind, src)
            if i < len(pooled) - 1:
                v = _layout_like(b, v, xm, src)  # each pass reads the last one's layout
    else:
        v = _reduce(b, x, pooled, kind, src)
        if kind == "avg":
            acc = v.tensor.dtype
            div = _divisors(windows, ins, outs, a)
            if isinstance(div, torch.Tensor):  # per output position
                # on the pooled tensor's device: a CPU table read by a GPU kernel is
                # a launch failure (a CPU 0-d scalar would be fine, a table is not)
                div = div.to(device=xm.device, dtype=acc)
                divisor = b.constant(div, f"{n.name}_divisor", src)
                v = b.call(aten.div.Tensor, v, divisor, source=src)
            elif div != 1:
                v = b.call(aten.div.Tensor, v, float(div), source=src)
            if acc != xm.dtype:
                v = b.call(aten._to_copy.default, v, dtype=xm.dtype, source=src)
    v = _layout_like(b, v, values, src)
    m = v.meta
    if not (
        isinstance(m, TensorMeta)
        and (m.shape, m.dtype) == (values.shape, values.dtype)
        and all(a == b for a, b, n in zip(m.stride, values.stride, m.shape) if n > 1)
    ):
        del b.nodes[nodes_before:]  # torch lays this pool out some other way: keep it
        return None
    return v


def _reduce(
    b: GraphBuilder,
    x: Node,
    pooled: Sequence[tuple[int, Window, int]],
    kind: str,
    src: Any,
) -> Node:
    """pad -> unfold (and a strided slice for dilation) along each (dim, window, output
    size) -> amax or sum over the window dimensions (contiguous, as torch infers it)."""
    aten = torch.ops.aten
    xm = x.tensor
    v = x
    pads = [0, 0] * (xm.ndim - min(d for d, _, _ in pooled))
    for d, w, o in pooled:
        j = 2 * (xm.ndim - 1 - d)  # constant_pad_nd lists the last dimension first
        pads[j] = w.pad
        pads[j + 1] = max((o - 1) * w.stride + w.span - xm.shape[d] - w.pad, 0)
    if any(pads):
        fill = float("-inf") if kind == "max" else 0.0
        v = b.call(aten.constant_pad_nd.default, v, pads, fill, source=src)
    for d, w, _ in pooled:
        v = b.call(aten.unfold.default, v, d, w.span, w.stride, source=src)
        if w.dilation > 1:
            v = b.call(aten.slice.Tensor, v, -1, 0, w.span, w.dilation, source=src)
    window_dims = list(range(-len(pooled), 0))
    if kind == "max":
        v = b.call(aten.amax.default, v, window_dims, source=src)
    else:
        acc = torch.float32 if xm.dtype in _LOW_PRECISION else xm.dtype
        v = b.call(aten.sum.dim_IntList, v, window_dims, False, dtype=acc, source=src)
    return v


def _layout_like(b: GraphBuilder, v: Node, like: TensorMeta, src: Any) -> Node:
    """torch pools channels-last input into channels-last output; a reduction's own result
    is contiguous. The copy is computed in the reduction's kernel (its lanes then run along
    the channels, which memory walks contiguously on both sides)."""
    if not is_channels_last(like) or is_channels_last(v.tensor) or v.tensor.ndim != like.ndim:
        return v
    fmt = torch.channels_last if like.ndim == 4 else torch.channels_last_3d
    return b.call(torch.ops.aten.clone.default, v, memory_format=fmt, source=src)


def _divisors(
    windows: Sequence[Window], ins: Sequence[int], outs: Sequence[int], a: dict[str, Any]
) -> torch.Tensor | int:
    """What torch's average pooling divides each output by (its CPU and CUDA kernels
    alike): divisor_override; else the window clipped to input + padding
    (count_include_pad) or to the input alone. An int where it is the same everywhere."""
    if a.get("divisor_override") is not None:
        return int(a["divisor_override"])
    with_pad = a.get("count_include_pad", True)
    per_dim: list[list[int]] = []
    for w, i, o in zip(windows, ins, outs):
        sizes = []
        for j in range(o):
            start = j * w.stride - w.pad
            end = min(start + w.size, i + w.pad)
            sizes.append(end - start if with_pad else min(end, i) - max(start, 0))
        per_dim.append(sizes)
    if all(len(set(s)) == 1 for s in per_dim):
        return math.prod(s[0] for s in per_dim)
    table = [math.prod(c) for c in itertools.product(*per_dim)]
    return torch.tensor(table, dtype=torch.float64).reshape([len(s) for s in per_dim])
