"""Constant folding: pointwise ops, views, reductions, matmuls/convolutions and index gathers
whose inputs are all frozen constants are evaluated once at compile time (the per-channel
scale of an inference BatchNorm, a standardised or weight-normed weight, a masked conv
weight, a relative position bias gathered from its table).
Splits become slices: each piece of split/chunk/unbind is a view kernels read through.
Copies a library call or the caller reads whole become kernels (`copies_in_kernels`)."""

from __future__ import annotations

import torch

from ..fusion.classify import SUPPORTED_DTYPES
from ..ir.graph import CONSTANT, GETITEM, Graph, GraphBuilder, Node, TensorMeta, bind
from ..ir.meta import sizes_in
from ..ir.ops import CONSTANT_FOLDABLE, VIEW_OPS, Kind, computed_where_read, info
from ..ir.size import is_size

MAX_FOLD_NUMEL = 1 << 22
MAX_GENERATED_NUMEL = 1 << 12  # tensors made from nothing (full, scalar_tensor) fold if small


def fold_constants(graph: Graph, folded: list[str] | None = None) -> Graph:
    """`graph` with every op on frozen constants alone evaluated; the ops that computed
    something (views aside) are appended to `folded`."""
    b = GraphBuilder().copy_from(graph)
    values: dict[Node, torch.Tensor] = {}
    tuples: dict[Node, tuple[torch.Tensor, ...]] = {}  # folded var_mean, max.dim, ...
    for n in graph.nodes:
        if n.op == CONSTANT:
            new = b.copy(n)
            values[new] = graph.constants[n.name]
            continue
        if n.op == GETITEM and n.args[0] in tuples:
            t = tuples[n.args[0]][n.args[1]]
        elif _foldable(n, b, values):
            args: tuple[object, ...] = tuple(_sub(a, b, values) for a in n.args)
            kwargs = {k: _sub(v, b, values) for k, v in n.kwargs}
            with torch.no_grad():
                out = n.target(*args, **kwargs)
            if folded is not None and info(n.op).kind != Kind.INJECTIVE and n.inputs():
                folded.append(n.op)
            if isinstance(n.meta, tuple):
                tuples[n] = tuple(out)
                b.copy(n)  # dead once every getitem of it is a constant
                continue
            t = out
        else:
            b.copy(n)
            continue
        meta = n.meta if isinstance(n.meta, TensorMeta) else None
        new = b.constant(t, n.name, n.source, meta)
        values[new] = t
        b.replace(n, new)
    return b.build(graph.outputs)


def storages(graph: Graph) -> frozenset[int]:
    """The storages of a graph's constants (before folding: the model's own tensors)."""
    return frozenset(t.untyped_storage().data_ptr() for t in graph.constants.values())


def fresh_outputs(graph: Graph, given: frozenset[int]) -> Graph:
    """Outputs that folding made constants, copied at every call: eager computes them anew
    each call, and a caller that writes into one (`out += 1`) must not change what the
    next call returns. A constant in one of the `given` storages (a parameter, or a view of
    one) is returned as it is, as eager returns it."""
    folded = [
        o
        for o in dict.fromkeys(graph.outputs)
        if isinstance(o, Node)
        and o.op == CONSTANT
        and graph.constants[o.name].untyped_storage().data_ptr() not in given
    ]
    if not folded:
        return graph
    b = GraphBuilder().copy_from(graph)
    for n in graph.nodes:
        b.copy(n)
    # one copy of an output returned twice, as eager returns one tensor twice
    copies = {o: b.call(torch.ops.aten.clone.default, b.get(o), source=o.source) for o in folded}
    return b.build([copies.get(o, o) if isinstance(o, Node) else o for o in graph.outputs])


def _foldable(n: Node, b: GraphBuilder, values: dict[Node, torch.Tensor]) -> bool:
    if n.op == GETITEM or not all(b.get(i) in values for i in n.inputs()):
        return False
    row = info(n.op)
    metas = n.meta if isinstance(n.meta, tuple) else (n.meta,)
    if not all(isinstance(m, TensorMeta) for m in metas):
        return False
    if any(is_size(v) for m in metas if isinstance(m, TensorMeta) for v in (*m.shape, m.offset)):
        # sized by a symbol (position embeddings gathered for the sequence length): folded,
        # its value would be this size's alone, and the compile could serve no other size
        return False
    if sizes_in(n.args, dict(n.kwargs)):
        # computed from a symbol (scalar_tensor(s0), math.sqrt of a size): torch would read
        # its value unrecorded, and the folded constant would be served at other sizes
        return False
    limit = MAX_FOLD_NUMEL if n.inputs() else MAX_GENERATED_NUMEL
    if sum(m.numel for m in metas if isinstance(m, TensorMeta)) > limit:
        return False
    if row.pointwise or row.index is not None or row.gather is not None:
        return isinstance(n.meta, TensorMeta)
    # Reductions, library calls and index gathers are deterministic: their value on
    # constants is a constant. Other opaque torch ops are not folded (random draws, ops
    # with side effects).
    deterministic = row.kind in (Kind.REDUCTION, Kind.ANCHOR) or n.op in CONSTANT_FOLDABLE
    return deterministic and bool(n.inputs())


def split_to_views(graph: Graph) -> Graph:
    """getitem(split(x, ...), k) -> slice(x, dim, start, end); getitem(unbind(x), k) ->
    select(x, dim, k). The same views torch returns, but ones a kernel reads through (a
    rotary embedding's chunk of q and k then fuses with the rest of it)."""
    b = GraphBuilder().copy_from(graph)
    aten = torch.ops.aten
    for n in graph.nodes:
        src = n.args[0] if n.op == GETITEM else None
        if not isinstance(src, Node) or src.op not in _SPLITS:
            b.copy(n)
            continue
        k = n.args[1]
        assert isinstance(k, int)
        a = bind(src)
        x = b.get(a["self"])
        dim = a["dim"]
        if src.op == "aten.unbind.int":
            new = b.call(aten.select.int, x, dim, k, source=n.source)
        else:
            sizes = [m.shape[dim] for m in src.meta]
            start = sum(sizes[:k])
            new = b.call(aten.slice.Tensor, x, dim, start, start + sizes[k], source=n.source)
        if new.meta != n.meta:  # torch made the pieces some other way: keep them
            b.nodes.remove(new)
            b.copy(n)
            continue
        b.replace(n, new)
    return b.build(graph.outputs)


_SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int")


def _sub(v: object, b: GraphBuilder, values: dict[Node, torch.Tensor]) -> object:
    if isinstance(v, Node):
        return values[b.get(v)]
    if isinstance(v, (list, tuple)):
        return type(v)(_sub(x, b, values) for x in v)
    return v


def copies_in_kernels(graph: Graph) -> Graph:
    """A cat, pad, flip or nearest upsampling that a convolution, matmul, torch op or the
    caller reads whole is read through by a copy (`clone`) in front of that reader, which
    the fusion pass treats like any pointwise op: the kernel that writes it also computes
    its pointwise producers and the copies it reads (a UNet decoder's cat of an upsampled
    map: one pass where torch made two). A copy kernels cannot read through (a cat of many
    inputs, nearest upsampling by 3) stays torch's."""
    b = GraphBuilder().copy_from(graph)
    aten = torch.ops.aten
    clones: dict[Node, Node] = {}

    def clone_of(a: Node) -> Node | None:
        root = a
        while root.op in VIEW_OPS and isinstance(root.args[0], Node):
            root = root.args[0]
        if not info(root.op).copies or not computed_where_read(root):
            return None
        m = a.meta
        if not isinstance(m, TensorMeta) or m.device != "cpu" or m.numel == 0:
            return None  # the C kernels run on the CPU; elsewhere torch's copy stays
        if m.dtype not in SUPPORTED_DTYPES:
            return None
        if a not in clones:
            clones[a] = b.call(aten.clone.default, b.get(a), source=a.source)
        return clones[a]

    for n in graph.nodes:
        if info(n.op).kind not in (Kind.ANCHOR, Kind.OPAQUE):
            b.copy(n)
            continue
        saved = {}
        for a in dict.fromkeys(n.inputs()):
            c = clone_of(a)
            if c is not None:
                saved[a] = b.get(a)
                b.replace(a, c)
        b.copy(n)
        for a, v in saved.items():
            b.replace(a, v)
    outs = []
    for o in graph.outputs:
        c = clone_of(o) if isinstance(o, Node) else None
        outs.append(c if c is not None else o)
    return b.build(outs)
