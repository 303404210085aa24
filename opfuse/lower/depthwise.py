"""A depthwise convolution's rows (rewrite/conv_rows.py) with their epilogue, as tiles: each
thread computes a tile of output pixels x all channels with opfuse's depthwise kernel
(backends/c/depthwise.py) into its slot of the scratch, then runs the epilogue over the
tile while it is in cache -- the GEMM epilogue's scheme (epilogue.lower_blocked), with
the convolution in place of the GEMM. A convolution over a few input channels
(`conv_rows`) takes the same tiles with opfuse's direct kernel
(backends/c/small_conv.py), reading its input in any layout; a 3x3, stride-1 one over
more channels takes tiles of whole output rows x a block of channels with opfuse's
Winograd kernel (backends/c/winograd.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..ir.graph import Graph, Node
from ..ir.index import Ix
from ..rewrite.conv_rows import DENSE, DEPTHWISE, SMALL_CHANNELS
from .epilogue import (
    _check_tile_local,
    _name,
    _read_tile_slot,
    const_root,
    in_place,
)
from .gemm_tiles import even_tiles, tile_slots
from .kernel import Kernel
from .lowering import NotFusable, _Lowering, lower_on_domain

# Floats of output a tile holds: with the input rows it reads, it stays in L2.
TILE_FLOATS = 1 << 15
MAX_TAPS = 49  # the kernel keeps a channel block's taps in registers: 7x7 at most
# the candidate each row producer's direct kernel is (Options.implementation)
IMPLEMENTATION = {DEPTHWISE: "opfuse-dw", DENSE: "opfuse-conv"}
WINOGRAD = "opfuse-winograd"  # a one-group 3x3 convolution over more channels
# Floats of transformed input (16 x 2x2 tiles x C) one Winograd task aims at: ~800 KB,
# which with its outputs' transforms stays in L2 (ResNet-50's layers, 2 threads: tasks of
# 7 row pairs at 56x56x64 ran 1.9x oneDNN's direct convolution, of 1 pair 1.5x).
WINOGRAD_FLOATS = 16 * 12544
WINOGRAD_BLOCK = 128  # output channels per task, at most (4 of the GEMM's panels)


@dataclass(frozen=True)
class Geometry:
    """The convolution's sizes: input N x H x W x C (NHWC), output OH x OW, kernel, stride,
    padding (top, left: the bottom and right ones are those OH and OW imply), dilation."""

    n: int
    h: int
    w: int
    c: int
    oh: int
    ow: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int


@dataclass(frozen=True)
class WinogradTasks:
    """How a Winograd kernel's work splits into tasks: bands of `band` output rows (even)
    of one image x blocks of `block` output channels (a multiple of 32); `work`: floats of
    work memory a task uses (laid out in backends/c/winograd.py)."""

    band: int
    block: int
    tasks: int
    work: int


@dataclass(frozen=True)
class DepthwiseKernel:
    """Tiles of a depthwise convolution's rows, the epilogue applied to each in cache."""

    name: str
    ops: tuple[str, ...]
    input: Node  # x, NHWC
    weight: Node  # the frozen filters, [C, 1, KH, KW]
    bias: Node | None  # frozen, [C]
    geometry: Geometry
    epilogue: Kernel
    gemm_buffer: str  # the epilogue's buffer that holds the convolution's result
    tile_m: int
    threads: int
    oc: int  # output channels (a depthwise one's are its input's)
    # a one-group convolution's (`conv_rows`) input strides (N, C, H, W), any layout; ()
    # for a depthwise one (dense NHWC input)
    x_strides: tuple[int, ...] = ()
    winograd: WinogradTasks | None = None  # a 3x3 one's tasks, as Winograd's F(2x2, 3x3)
    notes: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def dense(self) -> bool:
        return self.ops[0] == DENSE

    @property
    def implementation(self) -> str:
        return WINOGRAD if self.winograd is not None else IMPLEMENTATION[self.ops[0]]

    @property
    def in_place(self) -> bool:
        """The tiles are computed in the output itself (no epilogue)."""
        return in_place(self.epilogue, self.gemm_buffer)

    @property
    def tile_n(self) -> int:
        return self.winograd.block if self.winograd is not None else self.oc

    @property
    def rows(self) -> int:
        g = self.geometry
        return g.n * g.oh * g.ow

    @property
    def slots(self) -> int:
        if self.winograd is not None:
            return tile_slots(self.winograd.tasks, self.threads)
        return tile_slots(-(-self.rows // self.tile_m), self.threads)

    @property
    def scratch_bytes(self) -> int:
        tiles = 0 if self.in_place else self.slots * self.tile_m * self.tile_n
        work = self.slots * self.winograd.work if self.winograd is not None else 0
        return 4 * max(1, tiles + work)


def implementation_of(anchor: Node) -> str:
    """The candidate name of a row producer's own kernel."""
    x = anchor.args[0]
    assert isinstance(x, Node)
    if anchor.op == DENSE and x.tensor.shape[1] > SMALL_CHANNELS:
        return WINOGRAD
    return IMPLEMENTATION[anchor.op]


def lower_depthwise(
    graph: Graph, anchor: Node, members: Sequence[Node], threads: int
) -> DepthwiseKernel:
    x, w, bias, stride, padding, dilation = anchor.args
    assert isinstance(x, Node) and isinstance(w, Node)
    xm = x.tensor
    n, c, h, wd = xm.shape
    oc, kh, kw = w.tensor.shape[0], *w.tensor.shape[2:]
    dense = anchor.op == DENSE
    rows = anchor.tensor.shape[0]
    top, left = padding[:2]
    bottom, right = padding[2:] if len(padding) == 4 else padding  # (zero padding folded in)
    oh = (h + top + bottom - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + left + right - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    # the kernel reads the top and left padding; the bottom and right ones are in OH, OW
    geo = Geometry(n, h, wd, c, oh, ow, kh, kw, stride[0], stride[1], top, left, *dilation)
    if kh * kw > MAX_TAPS:
        raise NotFusable(f"a {kh}x{kw} window (opfuse's direct kernels take {MAX_TAPS} taps)")
    nhwc = (h * wd * c, 1, wd * c, c)
    if not dense and any(s != t for s, t, d in zip(xm.stride, nhwc, xm.shape) if d > 1):
        raise NotFusable("the depthwise kernel reads a dense NHWC input")
    if const_root(w) is not w or (isinstance(bias, Node) and const_root(bias) is None):
        raise NotFusable("opfuse's direct kernels pack frozen filters")
    assert rows == n * oh * ow
    rows = n * oh * ow  # (an expression of the input's sizes where they are symbolic)
    epi = [m for m in members if m is not anchor]
    tasks = _winograd(geo, oc, xm.stride, threads) if dense and c > SMALL_CHANNELS else None

    def value(low: _Lowering, idx: tuple[Ix, ...]) -> Any:
        return low._load(anchor, idx)

    kernel, low = lower_on_domain(graph, epi or [anchor], (rows, oc), {anchor: value})
    buf = low.in_buffers[anchor].name
    _check_tile_local(kernel, buf)
    tm = even_tiles(rows, max(1, TILE_FLOATS // oc), threads)
    if tasks is not None:
        tm = tasks.band * ow
    k = DepthwiseKernel(
        name=_name(anchor, epi),
        ops=(anchor.op, *(m.op for m in epi)),
        input=x,
        weight=w,
        bias=bias if isinstance(bias, Node) else None,
        geometry=geo,
        epilogue=kernel,
        gemm_buffer=buf,
        tile_m=tm,
        threads=threads,
        oc=oc,
        x_strides=tuple(xm.stride) if dense else (),
        winograd=tasks,
    )
    return k if k.in_place else replace(k, epilogue=_read_tile_slot(kernel, buf, k.tile_n))


def _winograd(geo: Geometry, oc: int, x_stride: Sequence[int], threads: int) -> WinogradTasks:
    """The tasks of a one-group convolution over more than a few channels, which only
    opfuse's Winograd kernel computes: 3x3, stride 1, dense NHWC input, every size but
    the batch known at compile time (a symbolic batch multiplies the tasks)."""
    g = geo
    if (g.kh, g.kw, g.sh, g.sw, g.dh, g.dw) != (3, 3, 1, 1, 1, 1):
        raise NotFusable("opfuse's Winograd kernel computes 3x3, stride-1 convolutions")
    nhwc = (g.h * g.w * g.c, 1, g.w * g.c, g.c)
    if any(s != t for s, t, d in zip(x_stride, nhwc, (g.n, g.c, g.h, g.w)) if d > 1):
        raise NotFusable("opfuse's Winograd kernel reads a dense NHWC input")
    tw, pairs = -(-g.ow // 2), -(-g.oh // 2)
    block = min(-(-oc // 32) * 32, WINOGRAD_BLOCK)
    blocks = -(-oc // block)
    bands = -(-pairs // max(1, WINOGRAD_FLOATS // (16 * g.c * tw)))
    # more, shorter bands for whole rounds of the threads: over the batch where it is
    # known, else per image (the same tasks for every batch size)
    images = g.n if type(g.n) is int else 1
    units = images * bands * blocks
    if units % threads:
        bands = min(pairs, -(-(-(-units // threads) * threads) // (images * blocks)))
    per = -(-pairs // bands)
    tasks = g.n * -(-pairs // per) * blocks
    # work memory (backends/c/winograd.py): a row of zeros, the 16 transformed inputs
    # (tiles x C) and the 16 products (tiles x block)
    return WinogradTasks(2 * per, block, tasks, g.c + 16 * per * tw * (g.c + block))
