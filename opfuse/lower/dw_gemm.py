"""A depthwise convolution's rows fed straight into the matmul that reads them (the 1x1
projection after MobileNet's depthwise 3x3): one kernel computes, per tile of output
pixels, the depthwise rows (opfuse's depthwise kernel), their epilogue, the matmul of those
rows with the packed weight (opfuse's GEMM) and the matmul's epilogue, all in cache. The
depthwise result never goes to memory: at MobileNetV2's batch 8 it is 3-13 MB a layer,
written and read back once each.

This is a candidate of the matmul's group ("opfuse-dw-gemm") that also does the work of
the depthwise group before it (`producer`); the tuner times it against the two groups run
as they would separately and keeps the faster (autotune.pair_depthwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..fusion.groups import Partition
from ..ir.graph import Graph, Node, TensorMeta
from ..ir.index import Ix, Var, address
from ..ir.ops import VIEW_OPS
from ..rewrite.conv_rows import DEPTHWISE
from .depthwise import DepthwiseKernel
from .epilogue import (
    TILE_COL,
    TILE_ROW,
    GemmKernel,
    GemmSpec,
    lower_blocked,
    own_gemm,
    tile_slots,
    whole_rounds,
)
from .kernel import Buffer, Kernel
from .lowering import NotFusable

# Floats of one tile: the depthwise result, its epilogue's output and the GEMM's result
# (rows x (2 C + N)); with the input rows the depthwise kernel reads, it stays in L2.
TILE_FLOATS = 1 << 15
NAME = "opfuse-dw-gemm"


@dataclass(frozen=True)
class DwGemmKernel:
    """Tiles of depthwise rows, their epilogue, and the matmul reading them with its
    epilogue. `dw.epilogue` stores the rows the matmul reads (`rows_value`) into the tile
    (`store_in_tile`); `gemm` tiles every column at once, `tile_m` rows at a time."""

    name: str
    ops: tuple[str, ...]
    dw: DepthwiseKernel
    gemm: GemmKernel
    rows_value: str  # the depthwise group's output the matmul reads: never stored
    producer: int  # the depthwise group's id
    tile_m: int
    threads: int

    implementation = NAME

    @property
    def input(self) -> Node:
        """The depthwise convolution's input, the tensor the plan hands over."""
        return self.dw.input

    @property
    def dw_buffers(self) -> list[Buffer]:
        """The depthwise epilogue's buffers the kernel takes as arguments: all but its
        result and the rows it stores in the tile."""
        d = self.dw
        return [
            b for b in d.epilogue.buffers if b.name != d.gemm_buffer and b.value != self.rows_value
        ]

    @property
    def gemm_buffer(self) -> str:
        """The buffer the runtime provides as scratch (the GEMM's result, renamed)."""
        return "g_" + self.gemm.gemm_buffer

    @property
    def epilogue(self) -> Kernel:
        """The buffers both epilogues take, in argument order (the depthwise one's, then
        the GEMM's), renamed apart: what the plan binds."""
        bufs = [replace(b, name="d_" + b.name) for b in self.dw_buffers]
        bufs += [replace(b, name="g_" + b.name) for b in self.gemm.epilogue.buffers]
        e = self.gemm.epilogue
        return Kernel(self.name, self.ops, tuple(bufs), e.outer, e.inner, ())

    @property
    def rows(self) -> int:
        return self.dw.rows

    @property
    def slots(self) -> int:
        return tile_slots(-(-self.rows // self.tile_m), self.threads)

    @property
    def slot_floats(self) -> int:
        """A thread's scratch: the depthwise result, the rows its epilogue makes, the GEMM's
        result, each tile_m rows."""
        g = self.dw.geometry
        return self.tile_m * (2 * g.c + self.gemm.spec.n)

    @property
    def scratch_bytes(self) -> int:
        return 4 * self.slots * self.slot_floats


def pair_depthwise_gemms(
    graph: Graph, part: Partition, candidates: Mapping[int, dict[str, Any]], threads: int
) -> None:
    """Add the fused candidate to each matmul group that reads a depthwise group's rows as
    its A operand, and is the only reader of them."""
    owner = part.group_of()
    for g in part.groups:
        cands = candidates.get(g.id, {})
        gk = cands.get("opfuse-gemm")
        if not isinstance(gk, GemmKernel) or g.anchor is None:
            continue
        s = gk.spec
        if s.kind == "bmm" or s.batch != 1 or s.a.trans or not s.packable:
            continue
        rows = _view_base(s.a.node)
        producer = owner.get(rows)
        if producer is None or producer.anchor is None or producer.anchor.op != DEPTHWISE:
            continue
        dk = candidates.get(producer.id, {}).get("opfuse-dw")
        if not isinstance(dk, DepthwiseKernel):
            continue
        try:
            cands[NAME] = _fuse(graph, g.anchor, g.nodes, s, dk, rows, producer.id, threads)
        except NotFusable:
            continue


def _fuse(
    graph: Graph,
    anchor: Node,
    members: list[Node],
    spec: GemmSpec,
    dk: DepthwiseKernel,
    rows: Node,
    producer: int,
    threads: int,
) -> DwGemmKernel:
    c = dk.geometry.c
    if (spec.m, spec.k, spec.a.ld) != (dk.rows, c, c):
        raise NotFusable("the matmul reads the rows in another shape")
    outs = [b for b in dk.epilogue.buffers if b.role == "out"]
    if len(outs) != 1 or outs[0].value != rows.name:
        raise NotFusable("the depthwise group has other outputs")
    if not _read_only_by(graph, rows, anchor):
        raise NotFusable("the rows are read by others too")
    epi = dk.epilogue if dk.in_place else store_in_tile(dk.epilogue, outs[0].name, c)
    n = spec.n
    tm = max(1, min(-(-dk.rows // threads), TILE_FLOATS // (2 * c + n)))
    tm = whole_rounds(dk.rows, tm, 1, threads)
    gk = own_gemm(lower_blocked(graph, anchor, members, threads, tile=(tm, n)))
    return DwGemmKernel(
        name=dk.name + "_" + gk.name.removeprefix("fused_"),
        ops=(*dk.ops, *gk.ops),
        dw=replace(dk, epilogue=epi),
        gemm=gk,
        rows_value=rows.name,
        producer=producer,
        tile_m=tm,
        threads=threads,
    )


def store_in_tile(k: Kernel, buf: str, ld: int) -> Kernel:
    """The depthwise epilogue storing `buf` into the tile (leading dimension ld, from the
    tile's origin) instead of at its place in the rows: where the matmul reads them."""
    *_, row, col = (*k.outer, *k.inner)
    own = address([Ix.var(row), Ix.var(col)], (ld, 1))
    at = (Ix.var(row) - Ix.var(Var(TILE_ROW, row.extent))) * ld + (
        Ix.var(col) - Ix.var(Var(TILE_COL, col.extent))
    )
    if len(k.passes) != 1 or k.passes[0].after or k.passes[0].accumulates:
        raise NotFusable("the depthwise epilogue is not pointwise")
    stores = []
    for s in k.passes[0].stores:
        if s.buffer == buf:
            if s.index != own or s.guard is not None:
                raise NotFusable("the depthwise epilogue stores its rows in another order")
            s = replace(s, index=at)
        stores.append(s)
    return replace(k, passes=(replace(k.passes[0], stores=tuple(stores)),))


def _view_base(n: Node) -> Node:
    """The value n views from its first element on (n itself if it is none's view)."""
    while n.op in VIEW_OPS and n.args and isinstance(n.args[0], Node):
        base = n.args[0]
        if not isinstance(base.meta, TensorMeta) or base.tensor.offset != n.tensor.offset:
            break
        n = base
    return n


def _read_only_by(graph: Graph, value: Node, anchor: Node) -> bool:
    """Is `value` read only by `anchor`, directly or through views, and never returned?"""
    stack = [value]
    while stack:
        n = stack.pop()
        if n in graph.output_set:
            return False
        for u in graph.users[n]:
            if u is anchor:
                continue
            if u.op not in VIEW_OPS:
                return False
            stack.append(u)
    return True
