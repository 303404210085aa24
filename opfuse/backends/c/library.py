"""Epilogue groups run as one library call: oneDNN's convolution and linear with their
post-ops, MKL's packed linear, oneDNN's linear over K in blocks.

Each call packs its frozen weight once. The packed weights serve any size of the input
(oneDNN and MKL take the sizes at run time; MKL's packed copy is the one for the rows it was
packed for, its plain weight for others), so a call is set up for the sizes of a graph with
symbolic sizes by `BuiltCall.at`: the same packed weights, with the shapes and layouts that
depend on the sizes evaluated at the symbols' values (runtime/sized.py serves them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...ir.graph import Graph, Node, TensorMeta, bind
from ...lower.epilogue import ADDITIVE, ERASES_NAN, OneDnnPlan, const_root
from ...lower.groups import k_blocks
from ...rewrite.layout import has_format, is_channels_last
from ...runtime.finite import FiniteGuard, gain, largest
from ...runtime.plan import BuiltCall

Values = Mapping[str, int]  # size symbols' values, by C name ({}: the compile's own)


def _at(n: Node, values: Values) -> TensorMeta:
    return n.tensor.at(values)


def onednn_call(graph: Graph, plan: OneDnnPlan, channels_last: bool = False) -> BuiltCall | None:
    a = plan.anchor
    if a.op == "aten.convolution.default" and plan.output.tensor.ndim == 2:
        return _rows(_conv_call(graph, dataclasses.replace(plan, output=a), True), plan.output)
    if a.op == "aten.convolution.default":
        return _conv_call(graph, plan, channels_last)
    return linear_call(graph, plan)


def _rows(conv: BuiltCall | None, matmul: Node) -> BuiltCall | None:
    """A convolution run for the rows that stand for it (rewrite/conv_rows.py: a 1x1
    one's matmul, a depthwise one's rows), its NHWC result returned as those rows: a
    view, no copy."""
    if conv is None or conv.at is None:
        return None
    conv_at = conv.at

    def at(values: Values) -> BuiltCall:
        call, rows = conv_at(values), list(_at(matmul, values).shape)

        def as_rows(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            return lambda *xs: fn(*xs).permute(0, 2, 3, 1).view(rows)

        guard = call.guard
        if guard is not None and guard.exact is not None:
            guard = dataclasses.replace(guard, exact=as_rows(guard.exact))
        return dataclasses.replace(call, call=as_rows(call.call), output=matmul, guard=guard, at=at)

    return at({})


def mkl_linear_call(graph: Graph, plan: OneDnnPlan) -> BuiltCall | None:
    """addmm / mm with a frozen weight as MKL's packed GEMM (what inductor's freezing
    uses): the weight is packed once here instead of on every call."""
    frozen = _frozen_linear(graph, plan.anchor)
    # torch.ops namespaces always exist; ask for the op itself (absent without MKL)
    if frozen is None or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return None
    x, weight, bias = frozen
    if weight.dtype != torch.float32 or x.tensor.dtype != torch.float32:
        return None
    # The packed copy is for these rows: at other row counts the call multiplies by the
    # plain weight (the same result).
    rows = _at(x, {}).shape[0]
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    op = torch.ops.mkl._mkl_linear

    def call(xv: torch.Tensor) -> torch.Tensor:
        return op(xv, packed, weight, bias, rows)

    def at(values: Values) -> BuiltCall:  # (it reads every size from its input)
        return BuiltCall(call, [x], plan.output, library="mkl", at=at)

    return at({})


def _frozen_linear(
    graph: Graph, anchor: Node
) -> tuple[Node, torch.Tensor, torch.Tensor | None] | None:
    """(input, weight as nn.Linear holds it [out, in], 1-D bias or None) of an addmm / mm
    whose weight and bias are frozen constants and which scales nothing; else None."""
    a = bind(anchor)
    addmm = anchor.op == "aten.addmm.default"
    x = a["mat1"] if addmm else a["self"]
    w_t = constant(graph, a["mat2"])
    if w_t is None:
        return None
    bias = constant(graph, a.get("self")) if addmm else None
    if addmm and (bias is None or a.get("alpha", 1) != 1 or a.get("beta", 1) != 1):
        return None
    if bias is not None and bias.ndim != 1:
        return None
    return x, w_t.t().contiguous(), bias


def constant(graph: Graph, n: Node | None) -> torch.Tensor | None:
    """A frozen constant, or a view of one (constant folding leaves views of large weights,
    e.g. the transpose of a 4096x4096 linear's) rebuilt with the node's layout; else None."""
    if n is None:
        return None
    if n.name in graph.constants:
        return graph.constants[n.name]
    root = const_root(n)
    if root is None:
        return None
    base = graph.constants[root.name]
    m = n.tensor
    return base.as_strided(m.shape, m.stride, base.storage_offset() + m.offset - root.tensor.offset)


def linear_call(graph: Graph, plan: OneDnnPlan) -> BuiltCall | None:
    frozen = _frozen_linear(graph, plan.anchor)  # oneDNN takes the [out, in] layout
    if frozen is None:
        return None
    x, weight, bias = frozen
    n = weight.shape[0]
    guard = _guard(plan, weight, bias)
    weight = _packed_for_onednn(weight, _at(x, {}).shape[0])
    op = torch.ops.mkldnn._linear_pointwise

    def at(values: Values) -> BuiltCall:
        out_shape = _at(plan.output, values).shape
        if plan.binary is None:

            def make(attr: str | None) -> Callable[..., torch.Tensor]:
                scalars = list(plan.scalars) if attr else []
                alg = plan.algorithm if attr else None

                def call(xv: torch.Tensor) -> torch.Tensor:
                    return op(xv, weight, bias, attr or "none", scalars, alg).view(out_shape)

                return call

            exact = _exact(guard, plan, make)
            return BuiltCall(make(plan.unary), [x], plan.output, guard=exact, at=at)
        assert plan.other is not None
        battr = plan.binary

        def call2(xv: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
            return op.binary(xv, other.reshape(-1, n), weight, bias, battr).view(out_shape)

        return BuiltCall(call2, [x, plan.other], plan.output, guard=_fresh(guard), at=at)

    return at({})


def chunked_linear_call(graph: Graph, plan: OneDnnPlan) -> BuiltCall | None:
    """x @ w.T + b as oneDNN's float32 GEMM over K in blocks (lower/groups.k_blocks): the
    first block's call adds the bias, each next one adds its product onto the result so far
    (oneDNN's binary-add post-op). oneDNN's one call sums K in one chain, 2-2.5x further
    from float64 than MKL's; in blocks it is as close as MKL's (lower/groups.K_BLOCK)."""
    frozen = _frozen_linear(graph, plan.anchor)
    if frozen is None:
        return None
    x, weight, bias = frozen
    rows, k = _at(x, {}).shape[0], weight.shape[1]
    cuts = k_blocks(k)
    blocks = [_packed_for_onednn(weight[:, lo:hi].contiguous(), rows) for lo, hi in cuts]
    op = torch.ops.mkldnn._linear_pointwise

    def call(xv: torch.Tensor) -> torch.Tensor:
        (lo, hi), first = cuts[0], blocks[0]
        out = op(xv[:, lo:hi], first, bias, "none", [], "")
        for (lo, hi), w in zip(cuts[1:], blocks[1:]):
            out = op.binary(xv[:, lo:hi], out, w, None, "add")
        return out

    def at(values: Values) -> BuiltCall:  # (it reads every size from its input)
        return BuiltCall(call, [x], plan.output, library="onednn-kblocks", at=at)

    return at({})


# The packed linears other than oneDNN's one call, by candidate (or PackedThenKernel
# library) name.
LINEAR_CALLS: dict[str, Callable[[Graph, OneDnnPlan], BuiltCall | None]] = {
    "mkl": mkl_linear_call,
    "onednn-kblocks": chunked_linear_call,
}


def _packed_for_onednn(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """The weight in oneDNN's blocked layout for `rows` input rows, packed once here (as
    inductor's freezing does) instead of reordered on every call: bfloat16 BERT-base
    linears 1024x768x3072 2.5 -> 2.1 ms. The plain weight if oneDNN cannot pack it."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except (RuntimeError, AttributeError):
        return weight


def _conv_call(graph: Graph, plan: OneDnnPlan, channels_last: bool) -> BuiltCall | None:
    a = bind(plan.anchor)
    x, w, b = a["input"], a["weight"], a["bias"]
    weight = constant(graph, w)
    bias = constant(graph, b) if b is not None else None
    if weight is None or (b is not None and bias is None) or a["transposed"]:
        return None
    stride, padding, dilation, groups = (
        list(a["stride"]),
        list(a["padding"]),
        list(a["dilation"]),
        a["groups"],
    )
    dims = weight.ndim - 2
    # NHWC graph: stay NHWC (a layout the symbolic sizes keep: the channels' stride is 1)
    channels_last = channels_last or is_channels_last(_at(plan.output, {}))
    if channels_last and dims not in (2, 3):
        return None
    packed: Any = weight
    if channels_last:
        # Prepacked (blocked) weights make oneDNN write NHWC; with NCHW wanted the plain
        # weight is faster than a packed convolution plus a copy back. (Packed for this
        # input's sizes; oneDNN runs it at any.)
        packed = _prepack(weight, dims, a, list(_at(x, {}).shape))
    cl = torch.channels_last if dims == 2 else torch.channels_last_3d
    fmt = cl if channels_last else None
    op, op_ = torch.ops.mkldnn._convolution_pointwise, torch.ops.mkldnn._convolution_pointwise_
    guard = _guard(plan, weight, bias)
    shape_args: tuple[Any, ...] = (packed, bias, padding, stride, dilation, groups)

    def to_fmt(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous(memory_format=cl)  # (used only where fmt is cl)

    def same(t: torch.Tensor) -> torch.Tensor:
        return t

    def at(values: Values) -> BuiltCall:
        # oneDNN picks its output layout itself (NHWC for few channels even from NCHW
        # input); callers and the memory plan expect the layout the graph inferred.
        want = torch.contiguous_format if _at(plan.output, values).is_contiguous() else cl

        def prep_for(n: Node) -> Callable[[torch.Tensor], torch.Tensor]:
            # A value the graph already lays out as oneDNN wants (NHWC between
            # convolutions) skips the per-call check (MobileNetV2 b1: 51 calls, ~2 us
            # each). One that comes out otherwise all the same is still correct: oneDNN
            # takes any strides.
            return to_fmt if fmt is not None and not has_format(_at(n, values), fmt) else same

        prep = prep_for(x)
        prep_other = prep_for(plan.other) if plan.other is not None else same

        def fix(y: torch.Tensor) -> torch.Tensor:
            return y if y.is_contiguous(memory_format=want) else y.contiguous(memory_format=want)

        if plan.binary is None:

            def make(attr: str | None) -> Callable[..., torch.Tensor]:
                scalars = list(plan.scalars) if attr else []
                alg = plan.algorithm if attr else None

                def call(xv: torch.Tensor) -> torch.Tensor:
                    return fix(op(prep(xv), *shape_args, attr or "none", scalars, alg))

                return call

            exact = _exact(guard, plan, make)
            return BuiltCall(make(plan.unary), [x], plan.output, guard=exact, at=at)

        def make2(attr: str | None) -> Callable[..., torch.Tensor]:
            rest: tuple[Any, ...] = (*shape_args, plan.binary, 1.0, attr, [], None)

            def call2(xv: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
                return fix(op.binary(prep(xv), prep_other(other), *rest))

            return call2

        call2, exact = make2(plan.unary), _exact(guard, plan, make2)
        assert plan.other is not None
        inputs = [x, plan.other]
        if plan.binary != "add" or fmt != (cl if want is cl else None):
            return BuiltCall(call2, inputs, plan.output, guard=exact, at=at)
        # oneDNN's sum post-op accumulates into `other` itself: when the residual is dead
        # after the conv (ResNet's block tail) no output is allocated and one pass over
        # memory saved.
        rest: tuple[Any, ...] = (*shape_args, plan.binary, 1.0, plan.unary, [], None)

        def call2_(xv: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
            return op_.binary(other, prep(xv), *rest)

        return BuiltCall(call2, inputs, plan.output, inplace=call2_, donor=1, guard=exact, at=at)

    return at({})


# torch's own post-ops, for the exact path of a guarded call: NaN stays NaN
_TORCH_POST: dict[str, Callable[..., torch.Tensor]] = {
    "relu": lambda y: torch.relu(y),
    "hardtanh": lambda y, lo, hi: torch.clamp(y, lo, hi),
    "hardsigmoid": lambda y: torch.nn.functional.hardsigmoid(y),
}
# The bound of a post-op's output as (cap, floor): max(min(b, cap), floor) for an input
# bounded by b. Exact for monotone clamps, whose largest |f| on [-b, b] is at an end.
_POST_BOUND: dict[str | None, Callable[..., tuple[float, float]]] = {
    None: lambda: (math.inf, 0.0),
    "relu": lambda: (math.inf, 0.0),
    "hardtanh": lambda lo, hi: (max(abs(lo), abs(hi)), max(0.0, lo, -hi)),
    "hardsigmoid": lambda: (1.0, 1.0),
}


def _guard(plan: OneDnnPlan, weight: torch.Tensor, bias: torch.Tensor | None) -> FiniteGuard | None:
    """Bounds through a oneDNN call (runtime/finite.py); None where its result has no bound from
    its inputs' (a product or quotient with `other`, a post-op outside _POST_BOUND such as
    gelu or silu, which keeps NaN): such a guard would neither decide nor carry anything,
    and cost a check per call."""
    post = _POST_BOUND.get(plan.unary)
    if plan.binary not in (None, *ADDITIVE) or post is None:
        return None
    return FiniteGuard(gain(weight), largest(bias), plan.binary is not None, post(*plan.scalars))


def _fresh(guard: FiniteGuard | None) -> FiniteGuard | None:
    """A guard of its own for each setup of a call (it counts its exact calls)."""
    return dataclasses.replace(guard) if guard is not None else None


def _exact(
    guard: FiniteGuard | None, plan: OneDnnPlan, make: Callable[[str | None], Callable[..., Any]]
) -> FiniteGuard | None:
    """The guard of a call whose post-op erases NaN gets the exact path: `make(None)` (the
    call without its post-op), then torch's post-op."""
    if guard is None or plan.unary not in ERASES_NAN:
        return _fresh(guard)
    plain, post, scalars = make(None), _TORCH_POST[plan.unary], plan.scalars

    def exact(*args: torch.Tensor) -> torch.Tensor:
        return post(plain(*args), *scalars)

    return dataclasses.replace(guard, exact=exact)


def _prepack(weight: torch.Tensor, dims: int, a: dict[str, Any], in_shape: list[int]) -> Any:
    reorder = {
        2: torch._C._nn.mkldnn_reorder_conv2d_weight,
        3: torch._C._nn.mkldnn_reorder_conv3d_weight,
    }[dims]
    try:
        return reorder(  # type: ignore[call-arg]
            weight.to_mkldnn(),
            list(a["padding"]),
            list(a["stride"]),
            list(a["dilation"]),
            a["groups"],
            in_shape,
        )
    except (RuntimeError, AttributeError):
        return weight


def describe(c: object) -> str:
    """A name-free description of a library candidate (oneDNN call or torch op)."""
    if isinstance(c, OneDnnPlan):
        nodes = [c.anchor, c.output] + ([c.other] if c.other is not None else [])
        metas = [(n.op, n.meta) for n in nodes]
        args = {k: (v.meta if isinstance(v, Node) else v) for k, v in bind(c.anchor).items()}
        return f"{metas} {args} {c.unary} {c.scalars} {c.algorithm} {c.binary}"
    return repr(c)
