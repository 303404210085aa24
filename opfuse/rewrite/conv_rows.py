"""Convolutions as producers of rows: over a channels-last input, a 1x1 convolution (stride
1, no padding, one group) is a matmul of the input's [N*H*W, C] rows with the weight's
[C, OC], and a depthwise one (one group per channel) a row producer of its own; so is a
convolution over a few input channels (an image's RGB stem: `SMALL_CHANNELS`), over any
input layout. Either way the channels-last output is the [N*OH*OW, OC] result seen through
a view and a permute:

    x [N,C,H,W] (NHWC in memory) -> permute -> view [NHW, C] -> addmm(bias, ., W^T [C, OC])
        -> view [N,H,W,OC] -> permute -> [N,OC,H,W] (NHWC in memory, as the convolution's)
    x -> opfuse::depthwise_rows(x, weight, bias, ...) [N*OH*OW, C] -> view -> permute
    x -> opfuse::conv_rows(x, weight, bias, ...) [N*OH*OW, OC] -> view -> permute

so the result takes its epilogue as a linear's does (bias, activation, residual add,
stored through the view and permute), with tiles of rows computed in cache. A zero
padding before the convolution (`constant_pad_nd`, as Hugging Face's MobileNets pad for
TensorFlow's "same", one side more than the other) is read as the convolution's own:
a depthwise one takes the four sides, a 1x1 one drops a padding of nothing. The tuner
weighs opfuse's GEMM (or its depthwise kernel), MKL's and torch's against the convolution
itself, run as before by oneDNN with its post-ops (`convolution_of` finds it again).
oneDNN's call through torch costs ~21 us before any work: opfuse's GEMM won on every 1x1
layer of MobileNetV2 at batch 1 (1.05-2.2x alone), oneDNN on some of ResNet-50's and at
batch 8. oneDNN's kernels vectorise over input channels too, which a 3-channel stem leaves
mostly empty: opfuse's direct kernel (backends/c/small_conv.py) vectorises over output
channels only. A 3x3, stride-1 convolution over more channels becomes rows too, for
opfuse's Winograd kernel (backends/c/winograd.py: 4/9 of the direct products).

Only float32 on the CPU, where opfuse's kernels run; other convolutions keep oneDNN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..ir.graph import CONSTANT, Graph, GraphBuilder, Node, TensorMeta, bind
from .layout import has_format, is_channels_last

CONV = "aten.convolution.default"
DEPTHWISE = "opfuse.depthwise_rows.default"
DENSE = "opfuse.conv_rows.default"
ROW_CONVS = (DEPTHWISE, DENSE)  # the row producers opfuse's direct kernels run
# Input channels up to which a convolution (one group, not 1x1) becomes rows for opfuse's
# direct kernel: an image's colour channels.
SMALL_CHANNELS = 4
_NHWC_ROWS, _NCHW = [0, 2, 3, 1], [0, 3, 1, 2]


def _rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    """A 2-D convolution's output as [N*OH*OW, OC] rows (its NHWC order), dense whatever
    layout the convolution chose. `padding`: [height, width], or [top, left, bottom, right]
    (zeros)."""
    if len(padding) == 4:
        top, left, bottom, right = padding
        x, padding = F.pad(x, (left, right, top, bottom)), [0, 0]
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return y.permute(0, 2, 3, 1).reshape(-1, weight.shape[0]).contiguous()


def _depthwise_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> torch.Tensor:
    """A depthwise convolution's rows (one group per channel)."""
    return _rows(x, weight, bias, stride, padding, dilation, x.shape[1])


def _conv_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> torch.Tensor:
    """A one-group convolution's rows."""
    return _rows(x, weight, bias, stride, padding, dilation, 1)


# The ops graphs hold (torch.ops.opfuse.*_rows); the same functions are their fake
# implementations: their torch ops run on fake tensors as they do on real ones (the rows
# are made dense, as fake and real convolutions may choose their layouts differently).
depthwise_rows = torch.library.custom_op("opfuse::depthwise_rows", mutates_args=())(_depthwise_rows)
depthwise_rows.register_fake(_depthwise_rows)
conv_rows = torch.library.custom_op("opfuse::conv_rows", mutates_args=())(_conv_rows)
conv_rows.register_fake(_conv_rows)


def convs_as_rows(
    graph: Graph, devices: Sequence[str] = ("cpu",), winograd: bool = True
) -> tuple[Graph, list[str]]:
    """`graph` with each eligible 1x1, depthwise, few-channel and (`winograd`) 3x3 stride-1
    convolution rewritten as rows on views; one line per rewritten convolution for the
    report."""
    b = GraphBuilder().copy_from(graph)
    notes: list[str] = []
    for n in graph.nodes:
        new = _rewrite(b, n, devices, allow_winograd=winograd)
        if new is None:
            b.copy(n)
            continue
        y, what = new
        b.replace(n, y)
        where = f" ({n.source.module})" if n.source is not None and n.source.module else ""
        notes.append(f"{n.name}{where}: {what}")
    if not notes:
        return graph, notes
    return b.build(graph.outputs), notes


def _rewrite(
    b: GraphBuilder, n: Node, devices: Sequence[str], allow_winograd: bool
) -> tuple[Node, str] | None:
    if n.op != CONV or not isinstance(n.meta, TensorMeta):
        return None
    a = bind(n)
    x, w, bias = a["input"], a["weight"], a["bias"]
    if not isinstance(x, Node) or not isinstance(w, Node):
        return None
    unpadded = _unpadded(x)
    pads = (0, 0, 0, 0)
    if unpadded is not None:
        x, pads = unpadded
    xm, wm, out = x.tensor, w.tensor, n.meta
    if (
        a["transposed"]
        or xm.ndim != 4
        or {xm.dtype, wm.dtype, out.dtype} != {torch.float32}
        or xm.device_type not in devices
        or xm.device_type != "cpu"
        or not _rows_layout(out)
        or out.numel == 0
    ):
        return None
    channels = xm.shape[1]
    # a few input channels: the direct kernel reads any layout (the stem reads the
    # caller's NCHW image, with no copy into NHWC first)
    dense = (
        a["groups"] == 1
        and channels <= SMALL_CHANNELS
        and tuple(wm.shape[2:]) != (1, 1)
        and w.op == CONSTANT  # packed once (backends/c/small_conv.py)
    )
    if not dense and not _rows_layout(xm):
        return None
    # a 3x3, stride-1 one over more channels: Winograd's F(2x2, 3x3), 4/9 of the products
    # (backends/c/winograd.py), NHWC input
    winograd = (
        allow_winograd
        and not dense
        and a["groups"] == 1
        and tuple(wm.shape[2:]) == (3, 3)
        and all(s == 1 for s in a["stride"])
        and all(d == 1 for d in a["dilation"])
        and w.op == CONSTANT  # transformed and packed once
    )
    dense = dense or winograd
    pointwise = (
        a["groups"] == 1
        and tuple(wm.shape[2:]) == (1, 1)
        and all(s == 1 for s in a["stride"])
        and all(p == 0 for p in (*a["padding"], *pads))
        and all(d == 1 for d in a["dilation"])
    )
    depthwise = (
        a["groups"] == channels == wm.shape[0]
        and wm.shape[1] == 1
        and w.op == CONSTANT  # packed once, taps first (backends/c/depthwise.py)
    )
    if not pointwise and not depthwise and not dense:
        return None
    # (torch.export may leave one value for both dims: padding="valid" is [0])
    stride, padding, dilation = (_pair(a[k]) for k in ("stride", "padding", "dilation"))
    if any(pads):  # the sides the pad added, onto the convolution's own
        top, left, bottom, right = pads
        padding = [padding[0] + top, padding[1] + left, padding[0] + bottom, padding[1] + right]
    aten = torch.ops.aten
    src = n.source
    batch, _, h, wd = xm.shape
    oc, oh, ow = out.shape[1], out.shape[2], out.shape[3]
    before = len(b.nodes)
    try:
        if pointwise:
            rows = b.call(aten.permute.default, b.get(x), _NHWC_ROWS, source=src)
            rows = b.call(aten.view.default, rows, [batch * h * wd, channels], source=src)
            weight = b.call(aten.view.default, b.get(w), [oc, channels], source=src)
            weight = b.call(aten.permute.default, weight, [1, 0], source=src)
            if isinstance(bias, Node):
                y = b.call(aten.addmm.default, b.get(bias), rows, weight, source=src)
            else:
                y = b.call(aten.mm.default, rows, weight, source=src)
        else:
            op = torch.ops.opfuse.depthwise_rows if depthwise else torch.ops.opfuse.conv_rows
            # (the rows as an expression of the output's sizes, which trial runs of the op
            # would not find: a batch times a window's count squared)
            like = TensorMeta((batch * oh * ow, oc), (oc, 1), out.dtype, out.device)
            y = b.call(
                op.default,
                b.get(x),
                b.get(w),
                b.get(bias) if isinstance(bias, Node) else None,
                stride,
                padding,
                dilation,
                source=src,
                like=like,
            )
        y = b.call(aten.view.default, y, [batch, oh, ow, oc], source=src)
        y = b.call(aten.permute.default, y, _NCHW, source=src)
    except Exception:  # a layout the rows cannot be viewed from, arguments torch refuses
        y = None
    m = y.meta if y is not None else None
    if not (
        isinstance(m, TensorMeta)
        and m.shape == out.shape
        and all(s == t for s, t, d in zip(m.stride, out.stride, out.shape) if d > 1)
    ):
        del b.nodes[before:]  # not the layout the convolution gave: keep it
        return None
    assert y is not None
    padded = " (the zero padding before it folded in)" if unpadded is not None else ""
    if pointwise:
        return y, "a 1x1 convolution, as a matmul over channels-last rows" + padded
    if depthwise:
        return y, "a depthwise convolution, as rows of its channels-last output" + padded
    if winograd:
        what = "a 3x3 convolution, as rows of its channels-last output (Winograd F(2x2, 3x3))"
        return y, what + padded
    what = f"a convolution over {channels} input channels, as rows of its channels-last output"
    return y, what + padded


def _rows_layout(m: TensorMeta) -> bool:
    """Is m laid out NHWC: channels-last, or 1x1 images, which are NCHW and NHWC alike (a
    squeeze-and-excitation branch's pooled [N, C, 1, 1], whose 1x1 convolutions are then
    matmuls rather than oneDNN calls of ~20 us each)."""
    return is_channels_last(m) or (
        m.ndim == 4 and m.numel > 0 and has_format(m, torch.channels_last) and m.shape[2:] == (1, 1)
    )


def _unpadded(x: Node) -> tuple[Node, tuple[int, int, int, int]] | None:
    """x as a zero padding of a 4-D tensor's height and width: that tensor, and the
    (top, left, bottom, right) sides added."""
    if x.op != "aten.constant_pad_nd.default":
        return None
    a = bind(x)
    src, pad, value = a["self"], list(a["pad"]), a.get("value", 0)
    if not isinstance(src, Node) or not isinstance(src.meta, TensorMeta) or src.tensor.ndim != 4:
        return None
    if value != 0 or len(pad) not in (2, 4) or any(not isinstance(p, int) or p < 0 for p in pad):
        return None
    left, right, top, bottom = (*pad, 0, 0)[:4]
    return src, (top, left, bottom, right)


def _pair(v: object) -> list[int]:
    vs = [v] if isinstance(v, int) else list(v)  # type: ignore[call-overload]
    return vs * 2 if len(vs) == 1 else vs


def convolution_of(graph: Graph, anchor: Node) -> tuple[Node, Node] | None:
    """The convolution a matmul or depthwise row producer `convs_as_rows` made computes,
    as a node outside the graph (oneDNN's call reads its arguments), and the permute that
    carries the rows out as that convolution's output; None for any other anchor, or where
    the rows (or their [N,H,W,C] view) are read other than through it."""
    users = graph.users
    out = list(users[anchor])
    if len(out) != 1 or out[0].op != "aten.view.default":
        return None
    out = users[out[0]]
    if len(out) != 1 or out[0].op != "aten.permute.default" or list(out[0].args[1]) != _NCHW:
        return None
    if anchor.op in ROW_CONVS:
        x, w, bias, stride, padding, dilation = anchor.args
        assert isinstance(x, Node) and isinstance(padding, list)
        if len(padding) == 4:  # a convolution pads both sides alike
            if padding[:2] != padding[2:]:
                return None
            padding = padding[:2]
        groups = x.tensor.shape[1] if anchor.op == DEPTHWISE else 1
        args = (x, w, bias, stride, padding, dilation, False, [0, 0], groups)
    elif anchor.op in ("aten.addmm.default", "aten.mm.default"):
        a = bind(anchor)
        rows, weight = (a["mat1"], a["mat2"]) if "mat1" in a else (a["self"], a["mat2"])
        bias = a["self"] if "mat1" in a else None
        x = _chain(rows, ("aten.view.default", None), ("aten.permute.default", _NHWC_ROWS))
        w = _chain(weight, ("aten.permute.default", [1, 0]), ("aten.view.default", None))
        if x is None or w is None or w.tensor.ndim != 4 or x.tensor.ndim != 4:
            return None
        args = (x, w, bias, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    else:
        return None
    if not isinstance(w, Node) or w.op != CONSTANT:
        return None
    conv = Node(
        f"{anchor.name}_as_convolution",
        CONV,
        args,
        meta=out[0].meta,
        source=anchor.source,
        target=torch.ops.aten.convolution.default,
    )
    return conv, out[0]


def _chain(n: object, *ops: tuple[str, list[int] | None]) -> Node | None:
    """What `n` is, read back through these ops in turn (a permute with these dims)."""
    for op, dims in ops:
        if not isinstance(n, Node) or n.op != op:
            return None
        if dims is not None and list(n.args[1]) != dims:
            return None
        n = n.args[0]
    return n if isinstance(n, Node) else None
