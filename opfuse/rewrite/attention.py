"""Attention as one call: softmax(scale * Q @ K^T + mask) @ V, written out in the model as
two batched matmuls around a softmax, becomes torch's fused scaled-dot-product attention
(flash attention on the CPU). The S x S scores and probabilities then never exist in
memory: a pre-norm block at batch 8 and 512 tokens holds 96 MiB of them per layer.

What is matched, on the decomposed inference graph (every intermediate read only inside
the pattern):

    s = bmm(q, k^T)         (through the views/copies matmul decomposes into)
    x = s [* c | / c]       scale by a Python number
    x = x [+ M | where(C, -inf, x)]
    p = exp(x - amax(x)) / sum(exp(...))     (optionally computed in float32)
    o = bmm(p, v)

Semantics match eager's with one exception handled explicitly: a row whose every score
is masked (-inf) is NaN in eager (0/0) but 0 in the fused kernel; `attention` sets such
rows to NaN, so the results agree on them too. NaN and Inf in q, k, v or the mask
propagate as in eager (checked: same NaN pattern). A `where` with a finite fill (e.g.
finfo.min) is only rewritten when the mask is a constant without fully masked rows: then
the masked terms underflow to exactly 0 in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ir import attention as _op  # noqa: F401  (defines the op this rewrite makes)
from ..ir.graph import CONSTANT, Graph, GraphBuilder, Node, bind
from ..ir.size import is_size

aten = torch.ops.aten

_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
_COPIES = ("aten.clone.default", "aten.expand.default", *_VIEWS)
_CONVERT = ("aten._to_copy.default", "prims.convert_element_type.default")
_FINITE_FILL = -1e30  # a finite `where` fill at most this is "minus infinity" for exp
# Scores per head from which the fused call is faster than the generated softmax between
# two GEMMs (GPT-2 block, batch 8, same process: 128 tokens 0%, 256 +3%, 512 +11%, 1024
# +20%; BERT-base batch 1: 16 tokens -4%, 64 -2%, 128 -4% to 0%, 192 0%, 256 +3%, 512
# +5%). Below it the scores are small.
MIN_SCORES = 256 * 256
# With the length a symbol, the scores per head up to which the attention is written out
# (`_fused`): at 512 tokens 5-11% slower than the fused call, at 1024 20%
MAX_WRITTEN = 512 * 512


@dataclass
class Match:
    out: Node  # the second bmm (or the view of it that restores the batch dims)
    q: Node
    kt: Node  # K^T: [..., D, Sk]
    v: Node
    scale: float
    mask: Node | None  # additive
    condition: Node | None  # where(condition, -inf, x) / where(condition, x, -inf)
    keep: bool  # the condition says which scores to keep (the second form), not to mask
    module: str


def fuse_attention(graph: Graph) -> tuple[Graph, list[str]]:
    """Rewrite every matched attention into one `opfuse.attention` call; also returns a
    line per rewrite for the report."""
    matches = {}
    notes = []
    for n in graph.nodes:
        if n.op == "aten.bmm.default":
            m = _match(graph, n)
            if m is None:
                continue
            sq, sk = m.q.tensor.shape[-2], m.kt.tensor.shape[-1]
            if _fused(sq * sk):
                matches[m.out] = m
            else:
                pays = MAX_WRITTEN + 1 if is_size(sq * sk) else MIN_SCORES
                varies = " with the length varying" if is_size(sq * sk) else ""
                notes.append(
                    f"{m.module or n.name}: kept as matmul, softmax, matmul ({sq}x{sk} scores "
                    f"per head; the fused call pays from {pays} scores{varies})"
                )
    if not matches:
        return graph, notes
    b = GraphBuilder().copy_from(graph)
    for n in graph.nodes:
        new = b.copy(n)
        m = matches.get(n)
        if m is None:
            continue
        k = b.call(aten.transpose.int, b.get(m.kt), -2, -1, source=n.source)
        mask = b.get(m.mask) if m.mask is not None else None
        if m.condition is not None:
            mask = _condition_mask(b, graph, m.condition, m.keep, m.q.tensor.dtype)
        att = b.call(
            torch.ops.opfuse.attention.default,
            b.get(m.q),
            k,
            b.get(m.v),
            mask,
            m.scale,
            source=n.source,
        )
        if att.tensor.shape != new.tensor.shape:  # 3-D bmm result without its 4-D view
            att = b.call(aten.reshape.default, att, list(new.tensor.shape), source=n.source)
        b.replace(n, att)
        s = (*m.q.tensor.shape[:-1], m.kt.tensor.shape[-1])
        notes.append(
            f"{m.module or n.name}: matmul, scale, mask, softmax, matmul -> one fused "
            f"attention call (the {'x'.join(map(str, s))} scores are never stored)"
        )
    return b.build(graph.outputs), notes


def _fused(scores: int) -> bool:
    """Does an attention with these scores per head run as the fused call? With the
    length a symbol (`scores` a Size), from MAX_WRITTEN on: below it the compile writes
    the attention out for every length it serves, the short ones (where that is faster)
    with the longer ones (at most 5-11% slower), instead of a compile per side of
    MIN_SCORES."""
    if is_size(scores):
        return scores > MAX_WRITTEN
    return scores >= MIN_SCORES


def _condition_mask(
    b: GraphBuilder, graph: Graph, cond: Node, keep: bool, dtype: torch.dtype
) -> Node:
    """The where's condition as the additive mask 0 / -inf."""
    # made on the condition's device: a GPU graph's kernels cannot read a CPU constant
    device = cond.tensor.device
    if cond.op == CONSTANT:
        t = torch.zeros(cond.tensor.shape, dtype=dtype, device=device)
        return b.constant(t.masked_fill(_masked(graph, cond, keep), -math.inf), f"{cond.name}_add")
    zero = b.constant(torch.zeros((), dtype=dtype, device=device), f"{cond.name}_zero")
    if keep:
        return b.call(aten.where.ScalarOther, b.get(cond), zero, -math.inf)
    return b.call(aten.where.ScalarSelf, b.get(cond), -math.inf, zero)


def _masked(graph: Graph, cond: Node, keep: bool) -> torch.Tensor:
    c = graph.constants[cond.name]
    return ~c if keep else c


# -- matching ----------------------------------------------------------------------------
def _read_only_by(graph: Graph, n: Node, *readers: Node) -> bool:
    """Is n no graph output, read by exactly these nodes (an intermediate of the pattern)?"""
    return n not in graph.output_set and sorted(map(id, graph.users[n])) == sorted(map(id, readers))


def _match(graph: Graph, bmm2: Node) -> Match | None:
    p3, v3 = bmm2.args[0], bmm2.args[1]
    if not isinstance(p3, Node) or not isinstance(v3, Node):
        return None
    # probabilities: back through views / identity expands / a dtype conversion to the div
    p, chain = _back(p3, _COPIES + _CONVERT)
    if p.op != "aten.div.Tensor" or not all(
        _read_only_by(graph, a, u) for a, u in [*chain, (p3, bmm2)]
    ):
        return None
    ex, total = p.args
    if not (isinstance(ex, Node) and isinstance(total, Node) and ex.op == "aten.exp.default"):
        return None
    if total.op != "aten.sum.dim_IntList" or total.args[0] is not ex or not _last_dim(total):
        return None
    sub = ex.args[0]
    if not isinstance(sub, Node) or sub.op != "aten.sub.Tensor":
        return None
    x, mx = sub.args
    if not (isinstance(x, Node) and isinstance(mx, Node)) or mx.op != "aten.amax.default":
        return None
    if mx.args[0] is not x or not _last_dim(mx):
        return None
    if not (
        _read_only_by(graph, ex, total, p)
        and _read_only_by(graph, total, p)
        and _read_only_by(graph, mx, sub)
        and _read_only_by(graph, sub, ex)
        and _read_only_by(graph, x, mx, sub)
    ):
        return None
    x, conv = _back(x, _CONVERT)  # softmax computed in float32 for a half-precision model
    if not all(_read_only_by(graph, a, u) for a, u in conv):
        return None
    return _scores(graph, x, bmm2, v3)


def _scores(graph: Graph, x: Node, bmm2: Node, v3: Node) -> Match | None:
    mask = condition = None
    keep = False
    top = x
    if x.op == "aten.add.Tensor" and bind(x).get("alpha", 1) == 1:
        for side, other in ((0, 1), (1, 0)):
            s, o = x.args[side], x.args[other]
            if isinstance(s, Node) and isinstance(o, Node) and _reaches_bmm(s):
                x, mask = s, o
                break
        else:
            return None
        if mask.tensor.dtype != x.tensor.dtype:
            return None
    elif x.op == "aten.where.self":
        cond, a, c = x.args
        keep = _scalar(graph, c) is not None  # where(keep, s, fill), else where(masked, fill, s)
        s, fill = (a, c) if keep else (c, a)
        if not (isinstance(cond, Node) and isinstance(s, Node)) or cond.tensor.dtype != torch.bool:
            return None
        value = _scalar(graph, fill)
        if value is None or value > _FINITE_FILL:
            return None
        if value != -math.inf and (cond.op != CONSTANT or _dead_rows(_masked(graph, cond, keep))):
            return None  # a finite fill on a fully masked row: eager gives a uniform row
        x, condition = s, cond
    if x is not top and (not _read_only_by(graph, x, top) or x.tensor.shape != top.tensor.shape):
        return None  # (a mask that broadcasts the scores to a larger shape: not attention's)
    scale = 1.0
    if x.op in ("aten.mul.Tensor", "aten.div.Tensor") and isinstance(x.args[1], (int, float)):
        c = float(x.args[1])
        if c == 0 or not math.isfinite(c):
            return None
        scale = c if x.op == "aten.mul.Tensor" else 1.0 / c
        nxt = x.args[0]
        if not isinstance(nxt, Node) or not _read_only_by(graph, nxt, x):
            return None
        x = nxt
    s4, chain = _back(x, _VIEWS)
    if s4.op != "aten.bmm.default" or not all(_read_only_by(graph, a, u) for a, u in chain):
        return None
    bmm1 = s4
    batch = x.tensor.shape[:-2]
    sq, sk = x.tensor.shape[-2:]
    a3, b3 = bmm1.args[0], bmm1.args[1]
    if not isinstance(a3, Node) or not isinstance(b3, Node):
        return None
    d, dv = a3.tensor.shape[-1], v3.tensor.shape[-1]
    q = _source(a3, (*batch, sq, d))
    kt = _source(b3, (*batch, d, sk))
    v = _source(v3, (*batch, sk, dv))
    if q is None or kt is None or v is None:
        return None
    dt = q.tensor.dtype
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if kt.tensor.dtype != dt or v.tensor.dtype != dt or x.tensor.dtype != dt:
        return None
    out = bmm2
    after = graph.users[bmm2]
    if (
        len(after) == 1
        and after[0].op in _VIEWS
        and after[0].tensor.shape == (*batch, sq, dv)
        and bmm2 not in graph.output_set
    ):
        out = after[0]
    module = bmm2.source.module if bmm2.source and bmm2.source.module else ""
    return Match(out, q, kt, v, scale, mask, condition, keep, module)


def _back(n: Node, ops: tuple[str, ...]) -> tuple[Node, list[tuple[Node, Node]]]:
    """Follow single-input views/copies/conversions upwards: (the first other node, the
    (node, its user) pairs passed)."""
    chain: list[tuple[Node, Node]] = []
    while n.op in ops and isinstance(n.args[0], Node):
        if n.op == "aten.expand.default" and n.args[0].tensor.shape != n.tensor.shape:
            break  # a real broadcast
        if n.op in _CONVERT and not n.tensor.dtype.is_floating_point:
            break
        chain.append((n.args[0], n))
        n = n.args[0]
    return n, chain


def _source(n: Node, shape: tuple[int, ...]) -> Node | None:
    """The tensor of `shape` that a bmm operand was copied/reshaped from: the farthest one
    up its chain of copies and views."""
    _, chain = _back(n, _COPIES)
    found = None
    for m in [n, *(a for a, _ in chain)]:
        if m.tensor.shape == shape:
            found = m
    return found


def _reaches_bmm(n: Node) -> bool:
    if n.op in ("aten.mul.Tensor", "aten.div.Tensor") and isinstance(n.args[0], Node):
        n = n.args[0]
    return _back(n, _VIEWS)[0].op == "aten.bmm.default"


def _last_dim(n: Node) -> bool:
    a = bind(n)
    dims = a.get("dim")
    ndim = n.args[0].tensor.ndim
    return bool(a.get("keepdim")) and list(dims or []) in ([-1], [ndim - 1])


def _scalar(graph: Graph, v: object) -> float | None:
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, Node) and v.op == CONSTANT and graph.constants[v.name].numel() == 1:
        return float(graph.constants[v.name])
    if isinstance(v, Node) and v.op == "aten.scalar_tensor.default":
        return float(v.args[0])
    return None


def _dead_rows(c: torch.Tensor) -> bool:
    return bool(c.ndim > 0 and c.all(-1).any())
