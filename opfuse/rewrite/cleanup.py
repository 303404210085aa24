"""Constant folding: pointwise ops and views whose inputs are all frozen constants are
evaluated once at compile time (e.g. the per-channel scale of an inference BatchNorm)."""

from __future__ import annotations

import torch

from ..ir.graph import CONSTANT, GETITEM, Graph, GraphBuilder, Node, TensorMeta
from ..ir.ops import Kind, info

MAX_FOLD_NUMEL = 1 << 22
MAX_GENERATED_NUMEL = 1 << 12  # tensors made from nothing (full, scalar_tensor) fold if small


def fold_constants(graph: Graph) -> Graph:
    b = GraphBuilder().copy_from(graph)
    values: dict[Node, torch.Tensor] = {}
    for n in graph.nodes:
        if n.op == CONSTANT:
            new = b.copy(n)
            values[new] = graph.constants[n.name]
            continue
        row = info(n.op)
        foldable = (
            n.op != GETITEM
            and (row.pointwise or (row.kind == Kind.INJECTIVE and row.index is not None))
            and isinstance(n.meta, TensorMeta)
            and n.meta.numel <= (MAX_FOLD_NUMEL if n.inputs() else MAX_GENERATED_NUMEL)
            and all(b.get(i) in values for i in n.inputs())
        )
        if not foldable:
            b.copy(n)
            continue
        args: tuple[object, ...] = tuple(_sub(a, b, values) for a in n.args)
        kwargs = {k: _sub(v, b, values) for k, v in n.kwargs}
        with torch.no_grad():
            t = n.target(*args, **kwargs)
        new = b.constant(t, n.name, n.source)
        values[new] = t
        b.replace(n, new)
    return b.build(graph.outputs)


def _sub(v: object, b: GraphBuilder, values: dict[Node, torch.Tensor]) -> object:
    if isinstance(v, Node):
        return values[b.get(v)]
    if isinstance(v, (list, tuple)):
        return type(v)(_sub(x, b, values) for x in v)
    return v
