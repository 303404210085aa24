"""1x1 convolutions as matmuls: a convolution with a 1x1 kernel, stride 1, no padding and one
group, over a channels-last input, is a matmul of the input's [N*H*W, C] rows with the
weight's [C, OC] -- and its channels-last output is that matmul's [N*H*W, OC] result, seen
through a view and a permute:

    x [N,C,H,W] (NHWC in memory) -> permute -> view [NHW, C] -> addmm(bias, ., W^T [C, OC])
        -> view [N,H,W,OC] -> permute -> [N,OC,H,W] (NHWC in memory, as the convolution's)

The matmul then takes its epilogue as any linear does (bias, activation, residual add,
stored through the view and permute), and the tuner weighs opfuse's GEMM, the blocked
library GEMM and MKL's against each other -- and against the convolution itself, run as
before by oneDNN with its post-ops (`convolution_of` finds it again): opfuse's GEMM won
on every 1x1 shape of MobileNetV2 at batch 1 (oneDNN's call through torch costs ~21 us
before any work; 1.05-2.2x), oneDNN on some of ResNet-50's and at batch 8.

Only float32 on the CPU, where opfuse's GEMMs run; other convolutions keep oneDNN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ir.graph import CONSTANT, Graph, GraphBuilder, Node, TensorMeta, bind
from .layout import is_channels_last

CONV = "aten.convolution.default"
_NHWC_ROWS, _NCHW = [0, 2, 3, 1], [0, 3, 1, 2]


def pointwise_convs_as_matmuls(
    graph: Graph, devices: Sequence[str] = ("cpu",)
) -> tuple[Graph, list[str]]:
    """`graph` with each eligible 1x1 convolution rewritten as a matmul on views; one line
    per rewritten convolution for the report."""
    b = GraphBuilder().copy_from(graph)
    notes: list[str] = []
    for n in graph.nodes:
        new = _rewrite(b, n, devices)
        if new is None:
            b.copy(n)
            continue
        b.replace(n, new)
        where = f" ({n.source.module})" if n.source is not None and n.source.module else ""
        notes.append(f"{n.name}{where}: a 1x1 convolution, as a matmul over channels-last rows")
    if not notes:
        return graph, notes
    return b.build(graph.outputs), notes


def _rewrite(b: GraphBuilder, n: Node, devices: Sequence[str]) -> Node | None:
    if n.op != CONV or not isinstance(n.meta, TensorMeta):
        return None
    a = bind(n)
    x, w, bias = a["input"], a["weight"], a["bias"]
    if not isinstance(x, Node) or not isinstance(w, Node):
        return None
    xm, wm, out = x.tensor, w.tensor, n.meta
    if (
        a["transposed"]
        or a["groups"] != 1
        or xm.ndim != 4
        or tuple(wm.shape[2:]) != (1, 1)
        or any(s != 1 for s in a["stride"])
        or any(p != 0 for p in a["padding"])
        or any(d != 1 for d in a["dilation"])
        or {xm.dtype, wm.dtype, out.dtype} != {torch.float32}
        or xm.device_type not in devices
        or xm.device_type != "cpu"
        or not is_channels_last(xm)
        or not is_channels_last(out)
        or out.numel == 0
    ):
        return None
    aten = torch.ops.aten
    src = n.source
    batch, chans, h, wd = xm.shape
    oc = wm.shape[0]
    before = len(b.nodes)
    try:
        rows = b.call(aten.permute.default, b.get(x), _NHWC_ROWS, source=src)
        rows = b.call(aten.view.default, rows, [batch * h * wd, chans], source=src)
        weight = b.call(aten.view.default, b.get(w), [oc, chans], source=src)
        weight = b.call(aten.permute.default, weight, [1, 0], source=src)
        if isinstance(bias, Node):
            y = b.call(aten.addmm.default, b.get(bias), rows, weight, source=src)
        else:
            y = b.call(aten.mm.default, rows, weight, source=src)
        y = b.call(aten.view.default, y, [batch, h, wd, oc], source=src)
        y = b.call(aten.permute.default, y, _NCHW, source=src)
    except RuntimeError:  # a layout the rows cannot be viewed from
        y = None
    m = y.meta if y is not None else None
    if not (
        isinstance(m, TensorMeta)
        and m.shape == out.shape
        and all(s == t for s, t, d in zip(m.stride, out.stride, out.shape) if d > 1)
    ):
        del b.nodes[before:]  # not the layout the convolution gave: keep it
        return None
    return y


def convolution_of(graph: Graph, anchor: Node) -> tuple[Node, Node] | None:
    """The convolution a matmul `pointwise_convs_as_matmuls` made computes, as a node
    outside the graph (oneDNN's call reads its arguments), and the permute that carries
    the matmul's result out as that convolution's output; None for any other matmul, or
    where the matmul's result (or its [N,H,W,OC] view) is read other than through it."""
    if anchor.op not in ("aten.addmm.default", "aten.mm.default"):
        return None
    a = bind(anchor)
    rows, weight = (a["mat1"], a["mat2"]) if "mat1" in a else (a["self"], a["mat2"])
    bias = a["self"] if "mat1" in a else None
    x = _chain(rows, ("aten.view.default", None), ("aten.permute.default", _NHWC_ROWS))
    w = _chain(weight, ("aten.permute.default", [1, 0]), ("aten.view.default", None))
    users = graph.users
    out = [u for u in users[anchor]]
    if len(out) != 1 or out[0].op != "aten.view.default":
        return None
    out = users[out[0]]
    if len(out) != 1 or out[0].op != "aten.permute.default" or list(out[0].args[1]) != _NCHW:
        return None
    if x is None or w is None or w.op != CONSTANT or w.tensor.ndim != 4 or x.tensor.ndim != 4:
        return None
    conv = Node(
        f"{anchor.name}_as_convolution",
        CONV,
        (x, w, bias, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
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
