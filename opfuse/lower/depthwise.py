"""A depthwise convolution's rows (rewrite/conv_rows.py) with their epilogue, as tiles: each
thread computes a tile of output pixels x all channels with opfuse's depthwise kernel
(backends/c/depthwise.py) into its slot of the scratch, then runs the epilogue over the
tile while it is in cache -- the GEMM epilogue's scheme (epilogue.lower_blocked), with
the convolution in place of the GEMM. A convolution over a few input channels
(`conv_rows`) takes the same tiles with opfuse's direct kernel
(backends/c/small_conv.py), reading its input in any layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..ir.graph import Graph, Node
from ..ir.index import Ix
from ..rewrite.conv_rows import DENSE, DEPTHWISE
from .epilogue import (
    _check_tile_local,
    _name,
    _read_tile_slot,
    const_root,
    even_tiles,
    in_place,
    tile_slots,
)
from .kernel import Kernel
from .lowering import NotFusable, _Lowering, lower_on_domain

# Floats of output a tile holds: with the input rows it reads, it stays in L2.
TILE_FLOATS = 1 << 15
MAX_TAPS = 49  # the kernel keeps a channel block's taps in registers: 7x7 at most
# the candidate each row producer's direct kernel is (Options.implementation)
IMPLEMENTATION = {DEPTHWISE: "opfuse-dw", DENSE: "opfuse-conv"}


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
    notes: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def dense(self) -> bool:
        return self.ops[0] == DENSE

    @property
    def implementation(self) -> str:
        return IMPLEMENTATION[self.ops[0]]

    @property
    def in_place(self) -> bool:
        """The tiles are computed in the output itself (no epilogue)."""
        return in_place(self.epilogue, self.gemm_buffer)

    @property
    def tile_n(self) -> int:
        return self.oc

    @property
    def rows(self) -> int:
        g = self.geometry
        return g.n * g.oh * g.ow

    @property
    def slots(self) -> int:
        return tile_slots(-(-self.rows // self.tile_m), self.threads)

    @property
    def scratch_bytes(self) -> int:
        return 4 * max(1, 0 if self.in_place else self.slots * self.tile_m * self.tile_n)


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

    def value(low: _Lowering, idx: tuple[Ix, ...]) -> Any:
        return low._load(anchor, idx)

    kernel, low = lower_on_domain(graph, epi or [anchor], (rows, oc), {anchor: value})
    buf = low.in_buffers[anchor].name
    _check_tile_local(kernel, buf)
    tm = even_tiles(rows, max(1, TILE_FLOATS // oc), threads)
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
    )
    return k if k.in_place else replace(k, epilogue=_read_tile_slot(kernel, buf, oc))
