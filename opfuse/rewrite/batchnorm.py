"""Inference BatchNorm: fold into the conv/linear before it (`fold_batchnorm`), or else
rewrite it as the per-channel affine map it is (`lower_batchnorm`), which then fuses with
its neighbours like any pointwise op."""

from __future__ import annotations

import torch

from ..ir.graph import GETITEM, Graph, GraphBuilder, Node

aten = torch.ops.aten
BN_INFERENCE = "aten._native_batch_norm_legit_no_training.default"


def lower_batchnorm(graph: Graph) -> Graph:
    """y = x * alpha + beta per channel, alpha = w / sqrt(var + eps), beta = b - mean*alpha,
    as ATen's CPU inference kernel computes it."""
    if not any(n.op == BN_INFERENCE for n in graph.nodes):
        return graph
    b = GraphBuilder().copy_from(graph)
    lowered: dict[Node, Node] = {}
    for n in graph.nodes:
        if n.op == BN_INFERENCE and _only_output_used(graph, n):
            lowered[n] = _affine(b, n)
        elif n.op == GETITEM and n.args[0] in lowered:
            b.replace(n, lowered[n.args[0]])
        else:
            b.copy(n)
    return b.build(graph.outputs)


def _only_output_used(graph: Graph, n: Node) -> bool:
    return all(u.op == GETITEM and u.args[1] == 0 for u in graph.users[n])


def _affine(b: GraphBuilder, n: Node) -> Node:
    x, w, bias, mean, var, _momentum, eps = (b.get(a) if isinstance(a, Node) else a for a in n.args)
    src = n.source
    out_dtype = n.meta[0].dtype
    inv = b.call(aten.rsqrt.default, b.call(aten.add.Tensor, var, eps, source=src), source=src)
    alpha = b.call(aten.mul.Tensor, inv, w, source=src) if w is not None else inv
    shift = b.call(aten.mul.Tensor, mean, alpha, source=src)
    beta = (
        b.call(aten.sub.Tensor, bias, shift, source=src)
        if bias is not None
        else b.call(aten.neg.default, shift, source=src)
    )
    shape = [x.tensor.shape[1]] + [1] * (x.tensor.ndim - 2)
    alpha_v = b.call(aten.view.default, alpha, shape, source=src)
    beta_v = b.call(aten.view.default, beta, shape, source=src)
    y = b.call(aten.mul.Tensor, x, alpha_v, source=src)
    y = b.call(aten.add.Tensor, y, beta_v, source=src)
    if y.tensor.dtype != out_dtype:
        y = b.call(aten._to_copy.default, y, dtype=out_dtype, source=src)
    return y
