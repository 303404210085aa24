"""Inference BatchNorm: fold it into the conv/linear before it (`fold_batchnorm`), or else
rewrite it as the per-channel affine map it is (`lower_batchnorm`), which then fuses with its
neighbours like any pointwise op.

Folding: y = BN(conv(x, W, b)) = conv(x, W', b') with, per output channel o,

    s[o] = gamma[o] / sqrt(var[o] + eps)
    W'[o, ...] = W[o, ...] * s[o]
    b'[o] = (b[o] - mean[o]) * s[o] + beta[o]

computed in float64 and cast back to the weight's dtype (values that would be subnormal there
are flushed to zero: subnormals slow CPU inference many times over). A transposed conv keeps
its weight as [in, out/groups, ...]: output channel g*(out/groups)+j lives in dim 1 of group
g's slice, so the scale is applied along dim 1 within each group, not along dim 0.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..ir.graph import CONSTANT, GETITEM, Graph, GraphBuilder, Node, contents
from ..ir.ops import short

aten = torch.ops.aten
BN_INFERENCE = "aten._native_batch_norm_legit_no_training.default"
BN_BATCH_STATS = "aten._native_batch_norm_legit.no_stats"
CONV = "aten.convolution.default"
LINEARS = ("aten.addmm.default", "aten.mm.default")


@dataclass(frozen=True)
class Fold:
    conv: str  # module (or value) name of the conv/linear
    batchnorm: str


@dataclass(frozen=True)
class Refusal:
    producer: str
    batchnorm: str
    reason: str


def _label(n: Node) -> str:
    return n.source.module if n.source and n.source.module else n.name


# -- folding ---------------------------------------------------------------------------------
@dataclass
class _Plan:
    kind: str  # "conv" | "linear"
    producer: Node
    weight: Node  # the constant (for linear: under a transpose view)


def fold_batchnorm(graph: Graph) -> tuple[Graph, list[Fold], list[Refusal]]:
    """Fold every foldable inference BatchNorm into the conv or linear that feeds it."""
    folds: list[Fold] = []
    refusals: list[Refusal] = []
    plans: dict[Node, _Plan] = {}
    for n in graph.nodes:
        if n.op == BN_INFERENCE:
            plan, reason = _plan(graph, n)
            if plan is None:
                src = n.args[0]
                refusals.append(
                    Refusal(_label(src) if isinstance(src, Node) else "?", _label(n), reason)
                )
            else:
                plans[n] = plan
        elif n.op == BN_BATCH_STATS:
            refusals.append(
                Refusal(
                    _label(n.args[0]),
                    _label(n),
                    "BatchNorm has no running statistics (track_running_stats=False): "
                    "it normalises with batch statistics",
                )
            )
    if not plans:
        return graph, folds, refusals
    b = GraphBuilder().copy_from(graph)
    folded: dict[Node, Node] = {}
    for n in graph.nodes:
        if n in plans:
            folded[n] = _fold(b, graph, n, plans[n])
            folds.append(Fold(_label(plans[n].producer), _label(n)))
        elif n.op == GETITEM and n.args[0] in folded:
            b.replace(n, folded[n.args[0]])
        else:
            b.copy(n)
    return b.build(graph.outputs), folds, refusals


def _plan(graph: Graph, bn: Node) -> tuple[_Plan | None, str]:
    x = bn.args[0]
    users = graph.users
    if any(u.op != GETITEM or u.args[1] != 0 for u in users[bn]):
        return None, "the BatchNorm's saved statistics are used"
    params = [a for a in bn.args[1:5] if isinstance(a, Node)]
    if any(p.op != CONSTANT for p in params):
        return None, "BatchNorm parameters are not frozen constants (torch.compile path)"
    if not isinstance(x, Node) or x.op not in (CONV, *LINEARS):
        return None, f"BatchNorm follows {x.op if isinstance(x, Node) else x}, not a conv or linear"
    n_users = len(users[x])
    if n_users != 1 or x in graph.output_set:
        return None, f"{short(x.op)} output has {n_users + (x in graph.output_set)} users"
    if x.op == CONV:
        weight, bias = x.args[1], x.args[2]
        kind = "conv"
    else:
        if len(x.tensor.shape) != 2:
            return None, "BatchNorm normalises another dim than the linear's output features"
        mat2 = x.args[2] if x.op == "aten.addmm.default" else x.args[1]
        bias = x.args[0] if x.op == "aten.addmm.default" else None
        if not (isinstance(mat2, Node) and mat2.op in ("aten.permute.default", "aten.t.default")):
            return None, "the linear's weight is not a transposed constant"
        weight = mat2.args[0]
        if len(users[mat2]) != 1:
            return None, "the linear's weight is shared with another op"
        kind = "linear"
    for p, what in ((weight, "weight"), (bias, "bias")):
        if p is None:
            continue
        if not isinstance(p, Node) or p.op != CONSTANT:
            return None, f"the {kind}'s {what} is not a frozen constant"
        if len(users[p]) != 1:
            return None, f"the {kind}'s {what} is shared with another op (a module called twice?)"
    if bias is not None and isinstance(bias, Node) and bias.tensor.ndim != 1:
        return None, f"the {kind}'s bias is not per channel"
    return _Plan(kind, x, weight), ""


def fold_weights(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
    *,
    transposed: bool = False,
    groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W', b' of a conv (or linear: weight [out, in]) followed by an inference BatchNorm."""
    w64 = weight.detach().double()
    c = mean.numel()
    s = torch.rsqrt(var.detach().double() + eps)
    if gamma is not None:
        s = s * gamma.detach().double()
    if transposed:
        in_ch = w64.shape[0]
        k = w64.shape[2:]
        grouped = w64.reshape(groups, in_ch // groups, c // groups, *k)
        scale = s.reshape(groups, 1, c // groups, *([1] * len(k)))
        w_new = (grouped * scale).reshape(w64.shape)
    else:
        w_new = w64 * s.reshape(c, *([1] * (w64.ndim - 1)))
    b64 = (
        bias.detach().double()
        if bias is not None
        else torch.zeros(c, dtype=torch.float64, device=mean.device)
    )
    b_new = (b64 - mean.detach().double()) * s
    if beta is not None:
        b_new = b_new + beta.detach().double()
    bias_dtype = bias.dtype if bias is not None else weight.dtype
    return _flush(w_new.to(weight.dtype)), _flush(b_new.to(bias_dtype))


# Folded weights by what they were folded from (each tensor's storage, address and version
# counter, and the fold's numbers): opfuse.compile over many input shapes folds each
# BatchNorm once (ResNet-50: 0.33 s a shape). An entry lives while a compiled graph holds
# its folded weight, which holds the tensors it came from: no other tensor can take their
# storage and be found by the old key.
_folds: weakref.WeakValueDictionary[Any, torch.Tensor] = weakref.WeakValueDictionary()


def _shared_fold(*args: Any, **how: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """fold_weights(*args, **how), found by what it is folded from where it was made."""
    key = (
        *((contents(a), a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
          for a in args),
        tuple(sorted(how.items())),
    )  # fmt: skip
    w = _folds.get(key)
    if w is None:
        w, b = fold_weights(*args, **how)
        # the sources held: their storage cannot be freed and found again by the old key
        w._opfuse_fold = (b, args)  # type: ignore[attr-defined]
        _folds[key] = w
    return w, w._opfuse_fold[0]  # type: ignore[attr-defined]


def forget_folds() -> None:
    """Fold every BatchNorm anew: after writes the version counters do not see."""
    _folds.clear()


def _flush(t: torch.Tensor) -> torch.Tensor:
    """Zero values that are subnormal in t's dtype."""
    tiny = torch.finfo(t.dtype).tiny
    return torch.where(t.abs() < tiny, torch.zeros_like(t), t).contiguous()


def _fold(b: GraphBuilder, graph: Graph, bn: Node, plan: _Plan) -> Node:
    x = plan.producer
    consts = graph.constants
    gamma, beta, mean, var = (consts[a.name] if isinstance(a, Node) else None for a in bn.args[1:5])
    eps = float(bn.args[6])
    assert mean is not None and var is not None
    src = x.source
    if plan.kind == "conv":
        inp, weight, bias, stride, padding, dilation, transposed, out_pad, groups = x.args
        w, bb = _shared_fold(
            consts[weight.name],
            consts[bias.name] if bias is not None else None,
            gamma,
            beta,
            mean,
            var,
            eps,
            transposed=bool(transposed),
            groups=int(groups),
        )
        wn = b.constant(w, f"{weight.name}_folded", weight.source)
        bn_ = b.constant(bb, f"{bn.name}_folded_bias", bn.source)
        return b.call(
            aten.convolution.default,
            b.get(inp),
            wn,
            bn_,
            stride,
            padding,
            dilation,
            transposed,
            out_pad,
            groups,
            source=src,
        )
    # linear: addmm(bias, x, W.t()) or mm(x, W.t())
    bias = x.args[0] if x.op == "aten.addmm.default" else None
    inp = x.args[1] if x.op == "aten.addmm.default" else x.args[0]
    w, bb = _shared_fold(
        consts[plan.weight.name],
        consts[bias.name] if isinstance(bias, Node) else None,
        gamma,
        beta,
        mean,
        var,
        eps,
    )
    wn = b.constant(w, f"{plan.weight.name}_folded", plan.weight.source)
    bn_ = b.constant(bb, f"{bn.name}_folded_bias", bn.source)
    wt = b.call(aten.permute.default, wn, [1, 0], source=src)
    return b.call(aten.addmm.default, bn_, b.get(inp), wt, source=src)


# -- what is left: BatchNorm as pointwise ops ---------------------------------------------------
def lower_batchnorm(graph: Graph) -> Graph:
    """Inference BatchNorm becomes y = x * alpha + beta per channel, alpha = w/sqrt(var+eps),
    beta = b - mean*alpha, as ATen's CPU inference kernel computes it. BatchNorm without
    running statistics becomes a var_mean reduction and the normalisation."""
    if not any(n.op in (BN_INFERENCE, BN_BATCH_STATS) for n in graph.nodes):
        return graph
    b = GraphBuilder().copy_from(graph)
    lowered: dict[Node, tuple[Node, ...]] = {}
    for n in graph.nodes:
        if n.op == BN_INFERENCE and _only_output_used(graph, n):
            lowered[n] = (_affine(b, n),)
        elif n.op == BN_BATCH_STATS:
            lowered[n] = _batch_stats(b, n)
        elif n.op == GETITEM and n.args[0] in lowered:
            b.replace(n, lowered[n.args[0]][n.args[1]])
        else:
            b.copy(n)
    return b.build(graph.outputs)


def _only_output_used(graph: Graph, n: Node) -> bool:
    return all(u.op == GETITEM and u.args[1] == 0 for u in graph.users[n])


def _channel_shape(x: Node) -> list[int]:
    return [x.tensor.shape[1]] + [1] * (x.tensor.ndim - 2)


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
    shape = _channel_shape(x)
    alpha_v = b.call(aten.view.default, alpha, shape, source=src)
    beta_v = b.call(aten.view.default, beta, shape, source=src)
    y = b.call(aten.mul.Tensor, x, alpha_v, source=src)
    y = b.call(aten.add.Tensor, y, beta_v, source=src)
    if y.tensor.dtype != out_dtype:
        y = b.call(aten._to_copy.default, y, dtype=out_dtype, source=src)
    return y


def _batch_stats(b: GraphBuilder, n: Node) -> tuple[Node, Node, Node]:
    """(out, mean, rstd) of BatchNorm over batch statistics, as torch's decomposition."""
    x, w, bias, _training, _momentum, eps = (b.get(a) if isinstance(a, Node) else a for a in n.args)
    src = n.source
    dims = [0, *range(2, x.tensor.ndim)]
    out_dtype = n.meta[0].dtype
    xf = x
    if x.tensor.dtype in (torch.float16, torch.bfloat16):
        xf = b.call(aten._to_copy.default, x, dtype=torch.float32, source=src)
    vm = b.call(aten.var_mean.correction, xf, dims, correction=0, keepdim=True, source=src)
    var = b.add(GETITEM, (vm, 0), meta=vm.meta[0], source=src, target=None)
    mean = b.add(GETITEM, (vm, 1), meta=vm.meta[1], source=src, target=None)
    rstd = b.call(aten.rsqrt.default, b.call(aten.add.Tensor, var, eps, source=src), source=src)
    y = b.call(aten.mul.Tensor, b.call(aten.sub.Tensor, xf, mean, source=src), rstd, source=src)
    shape = _channel_shape(x)
    if w is not None:
        y = b.call(aten.mul.Tensor, y, b.call(aten.view.default, w, shape, source=src), source=src)
    if bias is not None:
        y = b.call(
            aten.add.Tensor, y, b.call(aten.view.default, bias, shape, source=src), source=src
        )
    if y.tensor.dtype != out_dtype:
        y = b.call(aten._to_copy.default, y, dtype=out_dtype, source=src)
    flat_mean = b.call(aten.squeeze.dims, mean, dims, source=src)
    flat_rstd = b.call(aten.squeeze.dims, rstd, dims, source=src)
    return y, flat_mean, flat_rstd
