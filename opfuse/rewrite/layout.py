"""Channels-last: in a frozen graph with 2-D/3-D convolutions, activations flow between the
convolutions in NHWC (NDHWC) order instead of NCHW.

oneDNN computes convolutions in a channels-last or blocked layout; handed NCHW tensors, every
convolution reorders its input and its output. Here the weights become channels-last
constants, which makes torch's CPU convolution produce channels-last outputs, and every op
downstream is re-inferred from its new inputs: pointwise ops, pooling and reductions keep
the layout (the generated kernels read any strides). Graph outputs are copied back to the
layout eager returns them in, so callers see no difference.

The pass declines, leaving the graph as it was, where the new layout would change what a
view means or what the caller receives in a way a copy cannot repair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ir.graph import (
    CONSTANT,
    GETITEM,
    INPUT,
    Graph,
    GraphBuilder,
    Node,
    TensorMeta,
    bind,
    map_args,
)
from ..ir.meta import infer_meta

CONV = "aten.convolution.default"
_VIEWS = ("aten.view.default", "aten._unsafe_view.default")


@dataclass(frozen=True)
class Relayout:
    graph: Graph
    convolutions: int  # how many convolutions now run channels-last
    note: str  # what was done, or why not, in words


def channels_last(graph: Graph) -> Relayout:
    """Run the graph's convolutions and the ops between them channels-last."""
    convs = [n for n in graph.nodes if n.op == CONV and _eligible(graph, n)]
    if not convs:
        return Relayout(graph, 0, "")
    relayer = _Relayer(graph)
    try:
        new = relayer.rebuild({bind(c)["weight"] for c in convs})
    except _Decline as e:
        return Relayout(graph, 0, f"layout kept NCHW: {e}")
    except Exception as e:  # an op whose meta function rejects the new layout
        return Relayout(graph, 0, f"layout kept NCHW: {type(e).__name__}: {e}"[:300])
    # Each convolution fed channels-last saves oneDNN two reorders (its input, and the
    # output of the convolution before it); each copy back to NCHW costs one.
    fed = sum(1 for n in new.nodes if n.op == CONV and is_channels_last(bind(n)["input"].tensor))
    copies = len(relayer.copies)
    if 2 * fed <= copies:
        return Relayout(
            graph,
            0,
            f"layout kept NCHW: channels-last would spare {2 * fed} reorders "
            f"and cost {copies} copies",
        )
    return Relayout(
        new, len(convs), f"channels-last: {len(convs)} convolutions and the ops between them"
    )


class _Decline(Exception):
    pass


def _eligible(graph: Graph, conv: Node) -> bool:
    a = bind(conv)
    w = a["weight"]
    return (
        isinstance(w, Node)
        and w.op == CONSTANT
        and w.tensor.ndim in (4, 5)
        and not a["transposed"]
        and w.tensor.dtype in (torch.float32, torch.bfloat16)
    )


def _cl(ndim: int) -> torch.memory_format:
    return torch.channels_last if ndim == 4 else torch.channels_last_3d


def is_channels_last(m: TensorMeta) -> bool:
    """Whether m is laid out NHWC (NDHWC) and not also plain contiguous."""
    if m.ndim not in (4, 5) or m.numel <= 1:
        return False
    return has_format(m, _cl(m.ndim)) and not has_format(m, torch.contiguous_format)


def has_format(m: TensorMeta, fmt: torch.memory_format) -> bool:
    """Does a value of meta m have memory format fmt (is_contiguous(memory_format=fmt))?"""
    fake = torch.empty_strided(m.shape, m.stride, device="meta")
    return bool(fake.is_contiguous(memory_format=fmt))


def _cl_meta(m: TensorMeta) -> TensorMeta:
    """m laid out channels-last: computed from its sizes, so that Sizes (a graph with
    symbolic sizes) stay expressions in the strides."""
    # as torch's x.contiguous(memory_format=...) of a contiguous x: x itself where its
    # strides already are channels-last (C == 1, or H == W == 1)
    for order in (range(m.ndim), (0, *range(2, m.ndim), 1)):  # outermost first
        stride = [1] * m.ndim
        acc: int = 1
        for i in reversed(order):
            stride[i] = acc
            acc = acc * m.shape[i]
        meta = TensorMeta(m.shape, tuple(stride), m.dtype, m.device)
        if has_format(meta, _cl(m.ndim)):
            return meta
    raise AssertionError("unreachable: the second order is channels-last")


class _Relayer:
    """Copies a graph node by node, re-inferring each meta from the relaid inputs."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.b = GraphBuilder().copy_from(graph)
        self.copies: dict[Node, Node] = {}  # value -> its contiguous copy

    def rebuild(self, weights: set[Node]) -> Graph:
        b, changed = self.b, False
        for n in self.graph.nodes:
            if n.op == CONSTANT and n in weights:
                t = self.graph.constants[n.name]
                b.replace(n, b.constant(t.contiguous(memory_format=_cl(t.ndim)), n.name, n.source))
            elif n.op in (INPUT, CONSTANT) or n.target is None:
                b.copy(n)
            else:
                changed |= self.recreate(n).meta != n.meta
        if not changed:
            raise _Decline("no activation changed layout")
        return b.build([self.restore(o) if isinstance(o, Node) else o for o in self.graph.outputs])

    def recreate(self, n: Node) -> Node:
        """Copy `n` with its meta re-inferred from its (possibly relaid) inputs."""
        b = self.b
        args = tuple(map_args(a, b.get) for a in n.args)
        kwargs = {k: map_args(v, b.get) for k, v in n.kwargs}
        if n.op in _VIEWS:
            try:
                meta = infer_meta(n.target, args, kwargs, like=n.meta)
            except RuntimeError:
                # the view needs the old layout: make it contiguous first (one copy)
                src = args[0]
                assert isinstance(src, Node)
                args = (self.contiguous(src), *args[1:])
                meta = infer_meta(n.target, args, kwargs)
        elif n.op == GETITEM:
            parent, i = args
            assert isinstance(parent, Node) and isinstance(i, int)
            meta = parent.meta[i]
        else:
            meta = infer_meta(n.target, args, kwargs, like=n.meta)
            if n.op == CONV:
                meta = _conv_layout(args, meta)
        new = b.add(n.op, args, kwargs, meta=meta, name=n.name, source=n.source, target=n.target)
        b.replace(n, new)
        return new

    def contiguous(self, x: Node) -> Node:
        """x copied to the contiguous layout; one copy per value however many need it."""
        if x not in self.copies:
            self.copies[x] = self.b.call(
                torch.ops.aten.clone.default,
                x,
                memory_format=torch.contiguous_format,
                source=x.source,
            )
        return self.copies[x]

    def restore(self, old: Node) -> Node:
        """The new value of output `old`, in the layout eager returns it in."""
        new = self.b.get(old)
        if not isinstance(old.meta, TensorMeta) or new.meta == old.meta:
            return new
        if not old.tensor.is_contiguous():
            raise _Decline(f"output {old.name} has a layout a copy cannot reproduce")
        return self.contiguous(new)


def _conv_layout(args: tuple[object, ...], meta: TensorMeta) -> TensorMeta:
    # torch's meta function for convolution returns NCHW; the CPU kernel returns
    # channels-last when the input or the weight is channels-last. Follow the CPU.
    if any(isinstance(a, Node) and is_channels_last(a.tensor) for a in args[:2]):
        return _cl_meta(meta)
    return meta
