"""A depthwise convolution's rows fed straight into the matmul that reads them (the 1x1
projection after MobileNet's depthwise 3x3): one kernel computes, per tile of output
pixels, the depthwise rows (opfuse's depthwise kernel), their epilogue, the matmul of those
rows with the packed weight (opfuse's GEMM) and the matmul's epilogue, all in cache. The
depthwise result never goes to memory: at MobileNetV2's batch 8 it is 3-13 MB a layer,
written and read back once each.

This is a candidate of the matmul's group ("opfuse-dw-gemm") that also does the work of
the depthwise group before it (`producers`); the tuner times it against the two groups run
as they would separately and keeps the faster (autotune._pair). With the 1x1 expansion
before the depthwise convolution, "opfuse-expand-dw-gemm" does the work of all three.
Where no matmul reads the depthwise rows alone (a squeeze-and-excitation block between
them: MobileNetV3, EfficientNet), "opfuse-expand-dw", a candidate of the depthwise group,
does the expansion's work and its own, and stores the depthwise result: the expanded
tensor (7 MB at MobileNetV3's batch 8, 56x56x72) never goes to memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..fusion.groups import Group, Partition
from ..ir.graph import Graph, Node, TensorMeta
from ..ir.ops import VIEW_OPS
from ..rewrite.conv_rows import DEPTHWISE
from ..tools.caches import l2_bytes
from .depthwise import DepthwiseKernel, Geometry
from .epilogue import (
    GemmKernel,
    GemmSpec,
    lower_blocked,
    own_gemm,
    tile_index,
)
from .gemm_tiles import even_tiles, tile_slots
from .kernel import Buffer, Kernel
from .lowering import NotFusable

# Floats of one tile: the depthwise result, its epilogue's output and the GEMM's result
# (rows x (2 C + N)); with the input rows the depthwise kernel reads, it stays in L2.
TILE_FLOATS = 1 << 15
NAME = "opfuse-dw-gemm"
NAME3 = "opfuse-expand-dw-gemm"
NAME2 = "opfuse-expand-dw"  # the expansion and the depthwise convolution; no matmul


@dataclass(frozen=True)
class DwGemmKernel:
    """Tiles of depthwise rows, their epilogue, and the matmul reading them with its
    epilogue. `dw.epilogue` stores the rows the matmul reads (`rows_value`) into the tile
    (`store_in_tile`); `gemm` tiles every column at once, `tile_m` rows at a time.

    With `expand` (the 1x1 convolution's matmul whose result the depthwise convolution
    reads, `expanded_value`), tiles are bands of `band` output rows of one image: each
    computes the input rows its windows reach (a band's edge rows twice, once for each
    band) with that matmul and its epilogue, in cache, then the depthwise rows from them.
    Without `gemm` (then with `expand`), the depthwise epilogue stores its outputs."""

    name: str
    ops: tuple[str, ...]
    dw: DepthwiseKernel
    gemm: GemmKernel | None
    rows_value: str  # the depthwise group's output the matmul reads: never stored
    producers: tuple[int, ...]  # the groups whose work it does too, first to last
    tile_m: int
    threads: int
    expand: GemmKernel | None = None
    expanded_value: str = ""  # the expansion's output the depthwise reads: never stored
    band: int = 0

    @property
    def implementation(self) -> str:
        if self.gemm is None:
            return NAME2
        return NAME3 if self.expand is not None else NAME

    @property
    def input(self) -> Node:
        """The tensor the plan hands over: the expansion's input, or the depthwise one's."""
        return self.expand.spec.a.node if self.expand is not None else self.dw.input

    @property
    def expand_buffers(self) -> list[Buffer]:
        """The expansion epilogue's buffers the kernel takes: all but its result and its
        output (the rows it stores in the band)."""
        e = self.expand
        if e is None:
            return []
        return [
            b
            for b in e.epilogue.buffers
            if b.name != e.gemm_buffer and b.value != self.expanded_value
        ]

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
        """The buffer the runtime provides as scratch (the GEMM's result, renamed; without
        the GEMM, the depthwise result's)."""
        if self.gemm is None:
            return "d_" + self.dw.gemm_buffer
        return "g_" + self.gemm.gemm_buffer

    @property
    def epilogue(self) -> Kernel:
        """The buffers the epilogues take, in argument order (the expansion's, the
        depthwise one's, the GEMM's or else the scratch), renamed apart: what the plan
        binds."""
        bufs = [replace(b, name="e_" + b.name) for b in self.expand_buffers]
        bufs += [replace(b, name="d_" + b.name) for b in self.dw_buffers]
        if self.gemm is None:
            d = self.dw.epilogue
            result = next(b for b in d.buffers if b.name == self.dw.gemm_buffer)
            bufs.append(replace(result, name=self.gemm_buffer))
            return Kernel(self.name, self.ops, tuple(bufs), d.outer, d.inner, ())
        bufs += [replace(b, name="g_" + b.name) for b in self.gemm.epilogue.buffers]
        e = self.gemm.epilogue
        return Kernel(self.name, self.ops, tuple(bufs), e.outer, e.inner, ())

    @property
    def pixel_floats(self) -> int:
        """A tile's floats per output pixel: the depthwise result, [the rows its epilogue
        makes and the GEMM's result]."""
        c = self.dw.geometry.c
        return c if self.gemm is None else 2 * c + self.gemm.spec.n

    @property
    def rows(self) -> int:
        return self.dw.rows

    @property
    def tasks(self) -> int:
        """Tiles, or bands of output rows (n images x bands each)."""
        g = self.dw.geometry
        if self.expand is not None:
            return g.n * -(-g.oh // self.band)
        return -(-self.rows // self.tile_m)

    @property
    def band_rows(self) -> int:
        """The most input rows a band's windows reach."""
        g = self.dw.geometry
        return min(g.h, (self.band - 1) * g.sh + (g.kh - 1) * g.dh + 1)

    @property
    def slots(self) -> int:
        return tile_slots(self.tasks, self.threads)

    @property
    def slot_floats(self) -> int:
        """A thread's scratch: [the expansion's rows,] the depthwise result, the rows its
        epilogue makes, the GEMM's result, each tile_m rows."""
        g = self.dw.geometry
        expanded = self.band_rows * g.w * g.c if self.expand is not None else 0
        return expanded + self.tile_m * self.pixel_floats

    @property
    def scratch_bytes(self) -> int:
        return 4 * self.slots * self.slot_floats


def pair_depthwise_gemms(
    graph: Graph, part: Partition, candidates: Mapping[int, dict[str, Any]], threads: int
) -> None:
    """Add the fused candidate to each matmul group that reads a depthwise group's rows as
    its A operand, and is the only reader of them; and, where the depthwise convolution
    reads a 1x1 convolution's matmul group's result (alone), the candidate doing all three;
    where no matmul takes the depthwise rows so, the depthwise group's candidate doing the
    expansion's work and its own."""
    owner = part.group_of()
    paired: set[int] = set()  # depthwise groups a matmul's candidate may do the work of
    for g in part.groups:
        cands = candidates.get(g.id, {})
        gk = cands.get("opfuse-gemm")
        if not isinstance(gk, GemmKernel) or g.anchor is None:
            continue
        s = gk.spec
        if not _plain(s):
            continue
        rows = _view_base(s.a.node)
        producer = owner.get(rows)
        if producer is None or producer.anchor is None or producer.anchor.op != DEPTHWISE:
            continue
        dk = candidates.get(producer.id, {}).get("opfuse-dw")
        if not isinstance(dk, DepthwiseKernel):
            continue
        try:
            pair = _fuse(graph, g.anchor, g.nodes, s, dk, rows, producer.id, threads)
        except NotFusable:
            continue
        cands[NAME] = pair
        paired.add(producer.id)
        found = _expansion(owner, candidates, dk)
        if found is None:
            continue
        expanded, anchor, first, ek = found
        try:
            cands[NAME3] = _expand(
                graph, anchor, first.nodes, ek, pair, (expanded, producer.anchor), first.id
            )
        except NotFusable:
            continue
    for g in part.groups:
        dk = candidates.get(g.id, {}).get("opfuse-dw")
        if g.id in paired or not isinstance(dk, DepthwiseKernel) or g.anchor is None:
            continue
        found = _expansion(owner, candidates, dk)
        if found is None or dk.dense or dk.winograd is not None:
            continue  # (no expansion before it; not a depthwise convolution)
        expanded, anchor, first, ek = found
        alone = DwGemmKernel(dk.name, dk.ops, dk, None, "", (), 0, threads)
        try:
            fused = _expand(graph, anchor, first.nodes, ek, alone, (expanded, g.anchor), first.id)
        except NotFusable:
            continue
        candidates[g.id][NAME2] = fused


def _expansion(
    owner: Mapping[Node, Group], candidates: Mapping[int, dict[str, Any]], dk: DepthwiseKernel
) -> tuple[Node, Node, Group, GemmKernel] | None:
    """(the value the depthwise kernel reads, the anchor and group computing it, that
    group's opfuse-gemm candidate) where a matmul group with one computes the depthwise
    input."""
    expanded = _view_base(dk.input)
    first = owner.get(expanded)
    if first is None or first.anchor is None:
        return None
    ek = candidates.get(first.id, {}).get("opfuse-gemm")
    return (expanded, first.anchor, first, ek) if isinstance(ek, GemmKernel) else None


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
    out = _only_output(dk.epilogue, rows)
    if out is None:
        raise NotFusable("the depthwise group has other outputs")
    if not _read_only_by(graph, rows, anchor):
        raise NotFusable("the rows are read by others too")
    epi = dk.epilogue if dk.in_place else store_in_tile(dk.epilogue, out, c)
    n = spec.n
    tm = even_tiles(dk.rows, max(1, TILE_FLOATS // (2 * c + n)), threads)
    gk = own_gemm(lower_blocked(graph, anchor, members, threads, tile=(tm, n)))
    return DwGemmKernel(
        name=dk.name + "_" + gk.name.removeprefix("fused_"),
        ops=(*dk.ops, *gk.ops),
        dw=replace(dk, epilogue=epi),
        gemm=gk,
        rows_value=rows.name,
        producers=(producer,),
        tile_m=tm,
        threads=threads,
    )


def _expand(
    graph: Graph,
    anchor: Node,
    members: list[Node],
    ek: GemmKernel,
    pair: DwGemmKernel,
    reads: tuple[Node, Node],
    producer: int,
) -> DwGemmKernel:
    """The pair with the expansion before it (MobileNet's inverted residual block);
    `reads`: the expansion's result, and the depthwise convolution reading it."""
    expanded, dw_anchor = reads
    g, s = pair.dw.geometry, ek.spec
    if not _plain(s):
        raise NotFusable("the expansion is no plain matmul with a frozen weight")
    if (s.m, s.n) != (g.n * g.h * g.w, g.c):
        raise NotFusable("the expansion computes the depthwise input in another shape")
    out = _only_output(ek.epilogue, expanded)
    if ek.in_place or out is None:
        raise NotFusable("the expansion's epilogue stores other values")
    if not _read_only_by(graph, expanded, dw_anchor):
        raise NotFusable("the expansion's result is read by others too")
    threads = pair.threads
    band = band_height(g, pair.pixel_floats, threads)
    tm = band * g.ow
    e = own_gemm(lower_blocked(graph, anchor, members, threads, tile=(tm, g.c)))
    e = replace(e, epilogue=store_in_tile(e.epilogue, out, g.c))
    return replace(
        pair,
        name=e.name + "_" + pair.name.removeprefix("fused_"),
        ops=(*e.ops, *pair.ops),
        producers=(producer, *pair.producers),
        tile_m=tm,
        expand=e,
        expanded_value=expanded.name,
        band=band,
    )


def band_floats() -> int:
    """Floats of one band where the expansion is fused too (its rows, then the tile's):
    one core's L2. Each band computes again the expanded rows its windows share with the
    next, so taller bands do less work while they stay in L2: MobileNetV2 on a 1 MiB L2,
    against bands of half of it, ran 1.036-1.042x faster at batch 1 and 1.063-1.073x at
    batch 8 with bands of one or two L2s, 1.041x at batch 8 with four (same process,
    alternating rounds)."""
    return l2_bytes() // 4


def band_height(g: Geometry, pixel_floats: int, threads: int) -> int:
    """Output rows per band: a band per thread at least, and the tallest band whose floats
    (the input rows its windows reach, reach(b) = min(H, (b - 1) * sh + span), then its
    rows of `pixel_floats` a pixel) fit in `band_floats`, 1 at the least. One expression
    of the sizes (no search: with symbolic sizes every size prints it alike): the floats
    are the smaller of a line in b and the line with the reach at H, so the bands that fit
    are those under either line's bound."""
    budget = band_floats()
    start = max(1, min(g.oh, -(-g.n * g.oh // threads)))
    span = (g.kh - 1) * g.dh + 1
    per_row = g.ow * pixel_floats
    under_reach = (budget - (span - g.sh) * g.w * g.c) // (g.sh * g.w * g.c + per_row)
    under_whole = (budget - g.h * g.w * g.c) // per_row
    return max(1, min(start, max(under_reach, under_whole)))


def store_in_tile(k: Kernel, buf: str, ld: int) -> Kernel:
    """The depthwise epilogue storing `buf` into the tile (leading dimension ld, from the
    tile's origin) instead of at its place in the rows: where the matmul reads them."""
    own, at = tile_index(k, ld)
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


def _plain(s: GemmSpec) -> bool:
    """A matmul opfuse's GEMM runs in a fused kernel: one, A row-major, B frozen."""
    return s.kind != "bmm" and s.batch == 1 and not s.a.trans and s.packable


def _only_output(epilogue: Kernel, value: Node) -> str | None:
    """The buffer of `value` where it is the epilogue's one output, else None."""
    outs = [b for b in epilogue.buffers if b.role == "out"]
    return outs[0].name if len(outs) == 1 and outs[0].value == value.name else None


def _view_base(n: Node) -> Node:
    """The value n views from its first element on (n itself if it is none's view)."""
    while n.op in VIEW_OPS and n.args and isinstance(n.args[0], Node):
        base = n.args[0]
        if not isinstance(base.meta, TensorMeta) or base.tensor.offset != n.tensor.offset:
            break
        n = base
    return n


def _read_only_by(graph: Graph, value: Node, anchor: Node) -> bool:
    """Is `value` read only by `anchor`, directly or through views, and never returned?
    (Stricter than ir.uses.used_outside, which looks through any injective op: a copy of
    the value the anchor read otherwise would need it stored.)"""
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
