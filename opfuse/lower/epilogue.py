"""GEMM and convolution epilogues: an anchor (mm, addmm, bmm, convolution) plus the pointwise
ops that consume its result, lowered for each implementation opfuse can run them with:

- "blocked": generated C that calls the library GEMM one tile at a time (weights packed
  once at compile time) and applies the epilogue to the tile while it is still in cache;
- "opfuse-gemm": the same tiles computed by opfuse's own register-blocked GEMM (C, the
  weight packed once into panels of 32 columns) instead of the library;
- "onednn": PyTorch's oneDNN fused post-ops (mkldnn._linear_pointwise /
  _convolution_pointwise), when the epilogue is one of the activations (or one binary op,
  then relu) oneDNN fuses;
- "unfused": the library call, then the epilogue as its own generated kernel.

Which one runs is decided by timing them on the real shapes (autotune.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..ir.graph import CONSTANT, GETITEM, INPUT, STATIC, Graph, Node, bind
from ..ir.index import Ix, Var, address
from ..ir.ops import VIEW_OPS
from ..ir.scalar import walk
from ..ir.size import Decisions, deciding
from ..ir.uses import used_outside
from .gemm_tiles import OWN_PANEL, tile_slots, tiles
from .kernel import Kernel, map_indices
from .lowering import NotFusable, _Lowering, lower_group, lower_on_domain
from .schedule import inplace_pairs

GEMMS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
CONV = "aten.convolution.default"


@dataclass(frozen=True)
class Operand:
    """A GEMM operand as BLAS sees it: row-major with leading dimension `ld`, transposed
    when its storage holds the transpose."""

    node: Node
    trans: bool
    ld: int
    batch_stride: int = 0


@dataclass(frozen=True)
class GemmSpec:
    kind: str  # mm | addmm | bmm
    a: Operand
    b: Operand
    bias: Node | None
    alpha: float
    beta: float
    batch: int
    m: int
    n: int
    k: int
    packable: bool  # B is a frozen float32 constant: pack it once for the library
    # B is (a view of) a static graph input: opfuse's GEMM packs it on the first call and
    # again when it changes (runtime/execute.Packed)
    b_static: bool = False

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


def _operand(node: Node, rows: int, cols: int) -> Operand | None:
    m = node.tensor
    st = m.stride[-2:]
    batch = m.stride[0] if m.ndim == 3 else 0
    if st[1] == 1 and (st[0] >= max(cols, 1) or rows == 1):
        return Operand(node, False, max(st[0], cols, 1), batch)
    if st[0] == 1 and (st[1] >= max(rows, 1) or cols == 1):
        return Operand(node, True, max(st[1], rows, 1), batch)
    return None


def gemm_spec(anchor: Node) -> tuple[GemmSpec | None, str]:
    """The BLAS view of a matmul node, or why the blocked GEMM cannot run it."""
    a = bind(anchor)
    if anchor.op == "aten.addmm.default":
        x, w, bias = a["mat1"], a["mat2"], a["self"]
        alpha, beta = float(a.get("alpha", 1)), float(a.get("beta", 1))
    elif anchor.op == "aten.mm.default":
        x, w, bias, alpha, beta = a["self"], a["mat2"], None, 1.0, 0.0
    else:
        x, w, bias, alpha, beta = a["self"], a["mat2"], None, 1.0, 0.0
    out = anchor.tensor
    if (
        out.dtype != torch.float32
        or x.tensor.dtype != torch.float32
        or w.tensor.dtype != torch.float32
    ):
        return None, f"the blocked GEMM is float32 only ({out.dtype})"
    batch = out.shape[0] if anchor.op == "aten.bmm.default" else 1
    m, n = out.shape[-2], out.shape[-1]
    k = x.tensor.shape[-1]
    if min(batch, m, n, k) == 0:
        return None, "an empty matrix (torch's call handles it)"
    if out.stride[-1] != 1 or out.stride[-2] != n:
        return None, "the matmul output is not row-major"
    ao, bo = _operand(x, m, k), _operand(w, k, n)
    if ao is None or bo is None:
        return None, "a matmul input has a layout BLAS cannot read"
    not_bmm = anchor.op != "aten.bmm.default"
    packable = not_bmm and const_root(w) is not None
    b_static = not_bmm and static_root(w) is not None
    return GemmSpec(
        anchor.op.split(".")[1], ao, bo, bias, alpha, beta, batch, m, n, k, packable, b_static
    ), ""


def _view_root(n: Node) -> Node:
    """What n is (a chain of views of)."""
    while _is_view(n):
        n = n.args[0]
    return n


def const_root(n: Node) -> Node | None:
    """The frozen constant n is a view of, if any."""
    root = _view_root(n)
    return root if root.op == CONSTANT else None


def static_root(n: Node) -> Node | None:
    """The static graph input (a parameter dynamo passes) n is a view of, if any."""
    root = _view_root(n)
    return root if root.op == INPUT and root.kw.get(STATIC) else None


# -- the blocked kernel -------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmKernel:
    """GEMM tiles with the epilogue applied to each tile. `epilogue` runs over the GEMM's
    output domain ([batch,] M, N) with loop variables i0.. kept as they are; its buffer
    `gemm` holds the GEMM result (scratch the runtime provides)."""

    name: str
    ops: tuple[str, ...]
    spec: GemmSpec
    epilogue: Kernel
    gemm_buffer: str
    tile_m: int
    tile_n: int
    threads: int  # the thread count it was compiled for
    own: bool = False  # tiles computed by opfuse's GEMM (backends/c/own_gemm.py), not the library
    notes: dict[str, str] = field(default_factory=dict, compare=False)
    # the decisions its tiles took from the sizes (and its rendering and packing take):
    # the compile's only if it is the candidate chosen (ir/size.recording, adopt)
    decided: Decisions | None = field(default=None, compare=False)

    @property
    def implementation(self) -> str:
        return "opfuse-gemm" if self.own else "blocked"

    @property
    def packs_b(self) -> bool:
        """opfuse's GEMM packing B itself, tile by tile on every call: B is computed by
        the graph (attention's K and V) rather than a weight packed once."""
        return self.own and not (self.spec.packable or self.spec.b_static)

    @property
    def in_place(self) -> bool:
        """The GEMM writes its tiles straight into the output (no epilogue but the bias)."""
        return in_place(self.epilogue, self.gemm_buffer)

    @property
    def input(self) -> Node:
        """A, the operand the plan hands over as a tensor of the graph."""
        return self.spec.a.node

    @property
    def n_tiles(self) -> int:
        return self.spec.batch * -(-self.spec.m // self.tile_m) * -(-self.spec.n // self.tile_n)

    @property
    def slots(self) -> int:
        return tile_slots(self.n_tiles, self.threads)

    @property
    def pack_floats(self) -> int:
        """The floats of B one thread packs for a tile, where opfuse's GEMM packs B itself:
        the tile's panels of OWN_PANEL columns, K long."""
        return self.spec.k * -(-self.tile_n // OWN_PANEL) * OWN_PANEL if self.packs_b else 0

    @property
    def scratch_bytes(self) -> int:
        """The GEMM's scratch: a tile_m x tile_n slot of results per thread (none when the
        tiles are computed in the output), then a packing area per thread where the kernel
        packs B."""
        tiles = 0 if self.in_place else self.slots * self.tile_m * self.tile_n
        return 4 * max(1, tiles + self.slots * self.pack_floats)


def in_place(epilogue: Kernel, result: str) -> bool:
    """Does the epilogue store the tiled op's `result` buffer unchanged as its output (no
    epilogue): then the tiles are computed in the output itself."""
    g = next(b for b in epilogue.buffers if b.name == result)
    return any(b.role == "out" and b.value == g.value for b in epilogue.buffers)


def lower_blocked(
    graph: Graph,
    anchor: Node,
    members: Sequence[Node],
    threads: int,
    tile: tuple[int, int] | None = None,
    decided: Decisions | None = None,
) -> GemmKernel:
    """The GEMM in tiles (`tile`: rows x columns, taken with the decisions `decided`, else
    `tiles` chooses them), each tile's epilogue run while it is in cache."""
    spec, why = gemm_spec(anchor)
    if spec is None:
        raise NotFusable(why)
    domain = (spec.batch, spec.m, spec.n) if spec.kind == "bmm" else (spec.m, spec.n)
    epi = [m for m in members if m is not anchor]

    def gemm_value(low: _Lowering, idx: tuple[Ix, ...]) -> Any:
        v = low._load(anchor, idx)
        if spec.alpha != 1:
            v = v * spec.alpha
        if spec.bias is not None and spec.beta != 0:
            b = low.value(spec.bias, _broadcast_tail(idx, domain, spec.bias.tensor.shape))
            v = v + (b * spec.beta if spec.beta != 1 else b)
        return v

    # Without an epilogue the GEMM's own result (plus its bias) is the output: the tile is
    # computed in the output buffer and the bias added in place.
    kernel, low = lower_on_domain(graph, epi or [anchor], domain, {anchor: gemm_value})
    gemm_buf = low.in_buffers[anchor].name
    _check_tile_local(kernel, gemm_buf)
    if tile is None:
        with deciding() as decided:
            tile = tiles(spec, threads, epilogue=bool(epi))
    tm, tn = tile
    k = GemmKernel(
        name=_name(anchor, epi),
        ops=(anchor.op, *(m.op for m in epi)),
        spec=spec,
        epilogue=kernel,
        gemm_buffer=gemm_buf,
        tile_m=tm,
        tile_n=tn,
        threads=threads,
        decided=decided,
    )
    if k.in_place:
        return k
    epilogue = _read_tile_slot(kernel, gemm_buf, tn)
    read = {b.name: n for n, b in low.in_buffers.items()}
    over = _over_inputs(spec, epilogue, gemm_buf, read)
    return replace(k, epilogue=replace(epilogue, inplace=over))


def _over_inputs(
    spec: GemmSpec, kernel: Kernel, gemm_buf: str, read: dict[str, Node]
) -> tuple[tuple[str, str], ...]:
    """The epilogue's outputs that may be written over one of its inputs (the plan then
    gives them the input's memory where it is dead after: ResNet's residual, whose block
    the tail of each bottleneck overwrites, as oneDNN's sum post-op does; a fresh output
    costs a read of every line it writes, 1.3x the step's time at b8 in stage 1). Each
    tile's epilogue reads such an input only at the elements it writes; the GEMM's own
    operands never (other threads' tiles read all of A's columns and B). `kernel` reads
    the GEMM's results from the tile slot, so they are never a candidate."""
    operands = {_view_root(spec.a.node), _view_root(spec.b.node)}
    return tuple(
        (out, inp)
        for out, inp in inplace_pairs(kernel)
        if inp != gemm_buf and inp in read and _view_root(read[inp]) not in operands
    )


def own_gemm(k: GemmKernel) -> GemmKernel:
    """The blocked GEMM with its tiles computed by opfuse's GEMM: it reads A row-major and
    B from packed panels: a frozen weight packed at compile time, a static input packed by
    the runtime when it changes, any other B packed by the kernel, tile by tile."""
    if k.spec.a.trans:
        raise NotFusable("opfuse's GEMM reads the input row-major, not transposed")
    return replace(k, own=True)


# The origin of the tile being computed: C variables the renderer defines.
TILE_ROW, TILE_COL = "m0", "n0"


def tile_index(kernel: Kernel, ld: int) -> tuple[Ix, Ix]:
    """(the row-major index of the kernel's last two loop variables with leading
    dimension ld, the same position in a tile slot: (row - m0) * ld + (col - n0))."""
    *_, row, col = (*kernel.outer, *kernel.inner)
    own = address([Ix.var(row), Ix.var(col)], (ld, 1))
    at = (Ix.var(row) - Ix.var(Var(TILE_ROW, row.extent))) * ld + (
        Ix.var(col) - Ix.var(Var(TILE_COL, col.extent))
    )
    return own, at


def _read_tile_slot(kernel: Kernel, gemm_buf: str, tile_n: int) -> Kernel:
    """The epilogue reading the GEMM results from the thread's tile slot (leading
    dimension tile_n) instead of from their place in an [m, n] result."""
    at = tile_index(kernel, tile_n)[1]
    return map_indices(kernel, lambda ix: ix, lambda buf, ix: at if buf == gemm_buf else ix)


def _check_tile_local(kernel: Kernel, gemm_buf: str) -> None:
    """Each tile's epilogue may read only the GEMM results of that tile: the element at
    its own loop position. An epilogue whose output is a transpose of the GEMM's (attention's
    bmm -> transpose -> contiguous) runs over the output's positions, and would read results
    of tiles other threads have not computed yet."""
    buf = next(b for b in kernel.buffers if b.name == gemm_buf)
    own = address([Ix.var(v) for v in (*kernel.outer, *kernel.inner)], buf.stride)
    for p in kernel.passes:
        for e in walk([s.value for s in (*p.stores, *p.after)]):
            if e.op == "load" and e.value[0] == gemm_buf and e.value[1] != own:
                raise NotFusable(
                    "the epilogue reads the GEMM result in another order than the tiles "
                    "produce it (a transpose after the GEMM)"
                )


def _broadcast_tail(
    idx: tuple[Ix, ...], domain: Sequence[int], shape: Sequence[int]
) -> tuple[Ix, ...]:
    lead = len(domain) - len(shape)
    return tuple(Ix() if shape[k] == 1 else idx[k + lead] for k in range(len(shape)))


def _name(anchor: Node, epi: Sequence[Node]) -> str:
    from .lowering import kernel_name

    return kernel_name([anchor, *epi]).replace("fused_", "fused_", 1)


def lower_unfused(graph: Graph, anchor: Node, members: Sequence[Node]) -> Kernel:
    """The epilogue as a kernel of its own, reading the library call's result."""
    return lower_group(graph, [m for m in members if m is not anchor])


# -- oneDNN post-ops ----------------------------------------------------------------------------
UNARY = {
    "aten.relu.default": "relu",
    "aten.gelu.default": "gelu",
    "aten.silu.default": "swish",
    "aten.sigmoid.default": "sigmoid",
    "aten.tanh.default": "tanh",
    "aten.hardswish.default": "hardswish",
    "aten.hardsigmoid.default": "hardsigmoid",
    "aten.leaky_relu.default": "leaky_relu",
    "aten.hardtanh.default": "hardtanh",
    "aten.clamp.default": "hardtanh",
}
BINARY = {
    "aten.add.Tensor": "add",
    "aten.sub.Tensor": "sub",
    "aten.mul.Tensor": "mul",
    "aten.div.Tensor": "div",
}
COMMUTATIVE = frozenset({"aten.add.Tensor", "aten.mul.Tensor"})
# Post-ops oneDNN computes with max/min, which turn NaN into a bound (relu(NaN) = 0 where
# eager gives NaN): they run fused only behind a finiteness guard (runtime/finite.py). Measured on
# every UNARY attribute with NaN and +-inf inputs; the others keep NaN and inf as eager.
ERASES_NAN = frozenset({"relu", "hardtanh", "hardsigmoid"})
# Binary ops whose result a bound on both operands bounds (the guard needs one).
ADDITIVE = frozenset({"add", "sub"})


@dataclass(frozen=True)
class PackedThenKernel:
    """The anchor as a library GEMM with its weight packed once (MKL's for float32,
    oneDNN's for bfloat16/float16), then the unfused epilogue kernel: the unfused
    implementation without torch's per-call weight handling."""

    anchor: Node
    kernel: Kernel
    library: str = "mkl"  # "mkl" | "onednn" | "onednn-kblocks"


@dataclass(frozen=True)
class OneDnnPlan:
    anchor: Node
    output: Node  # the value the fused call produces (the last epilogue op)
    unary: str | None = None
    scalars: tuple[Any, ...] = ()
    algorithm: str | None = None
    binary: str | None = None
    other: Node | None = None  # the binary op's second operand


def _is_view(n: Node) -> bool:
    """An op whose result is its first argument's data read through an index map."""
    return n.op in VIEW_OPS and n.op != GETITEM and bool(n.args) and isinstance(n.args[0], Node)


def _through_views(n: Node, target: Node) -> bool:
    while n is not target:
        if not _is_view(n):
            return False
        n = n.args[0]
    return True


def _unary(n: Node, src: Node) -> tuple[str, tuple[Any, ...], str | None] | None:
    attr = UNARY.get(n.op)
    if attr is None or not isinstance(n.args[0], Node) or not _through_views(n.args[0], src):
        if n.op == "aten.mul.Tensor":  # x * sigmoid(x): Swish written out
            a, b = n.args[0], n.args[1]
            if (
                isinstance(a, Node)
                and isinstance(b, Node)
                and b.op == "aten.sigmoid.default"
                and _through_views(a, src)
                and _through_views(b.args[0], src)
            ):
                return "swish", (), None
        return None
    a = bind(n)
    if attr == "gelu":
        return attr, (), a.get("approximate", "none")
    if attr == "leaky_relu":
        return attr, (a.get("negative_slope", 0.01),), None
    if attr == "hardtanh":
        lo = a.get("min_val", a.get("min"))
        hi = a.get("max_val", a.get("max"))
        if lo is None or hi is None or isinstance(lo, Node) or isinstance(hi, Node):
            return None
        return attr, (lo, hi), None
    return attr, (), None


def match_onednn(
    graph: Graph, anchor: Node, members: Sequence[Node], conv: Node | None = None
) -> OneDnnPlan | None:
    """The epilogue as oneDNN post-ops: one activation; or one binary op with another
    tensor of the output's shape, optionally followed by relu (convolution only). `conv`:
    the convolution a matmul computes (rewrite/conv_rows.convolution_of), which the
    plan runs instead, its post-ops reading the matmul's result through views."""
    epi = [m for m in members if m is not anchor]
    if anchor.tensor.dtype not in (torch.float32, torch.bfloat16):
        return None
    is_conv = anchor.op == CONV or conv is not None
    if anchor.op == CONV:
        if bind(anchor)["transposed"]:
            return None
    elif conv is not None:
        pass
    elif (
        anchor.op not in ("aten.addmm.default", "aten.mm.default")
        or const_root(bind(anchor)["mat2"]) is None
        or anchor.tensor.ndim != 2
    ):
        return None
    if not epi:
        return None
    last = epi[-1]
    if len(epi) == 1 or (
        len(epi) == 2 and epi[1].op == "aten.mul.Tensor" and epi[0].op == "aten.sigmoid.default"
    ):
        u = _unary(last, anchor)
        if u is not None:
            return OneDnnPlan(conv or anchor, last, u[0], u[1], u[2])
    first = epi[0]
    attr = BINARY.get(first.op)
    if attr is None or len(epi) > 2:
        return None
    x, other = first.args[0], first.args[1]
    if first.op in COMMUTATIVE and isinstance(other, Node) and _through_views(other, anchor):
        x, other = other, x  # residual + conv(x): oneDNN adds `other` to its result either way
    if not (isinstance(x, Node) and isinstance(other, Node) and _through_views(x, anchor)):
        return None
    if other.tensor.numel != anchor.tensor.numel or bind(first).get("alpha", 1) != 1:
        return None
    if len(epi) == 2:
        if not is_conv or epi[1].op != "aten.relu.default" or epi[1].args[0] is not first:
            return None
        if attr not in ADDITIVE:  # conv * other (or / other) can be NaN with finite inputs
            return None
        return OneDnnPlan(conv or anchor, epi[1], "relu", (), None, attr, other)
    return OneDnnPlan(conv or anchor, first, None, (), None, attr, other)


def epilogue_outputs(graph: Graph, members: Sequence[Node]) -> list[Node]:
    """Values of the group read outside it (by the lowering's rule: what it must store)."""
    inside = set(members)
    return [m for m in members if used_outside(graph, m, inside)]
