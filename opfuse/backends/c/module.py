"""All candidate kernels of a graph -> translation units -> one loaded library, and the
runnable objects (plan.Built*) for every candidate, oneDNN calls included."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...ir.graph import Graph, Node, bind
from ...ir.size import Size, symbolic_text, value
from ...lower.depthwise import DepthwiseKernel
from ...lower.dw_gemm import DwGemmKernel
from ...lower.epilogue import (
    ADDITIVE,
    ERASES_NAN,
    GemmKernel,
    OneDnnPlan,
    PackedThenKernel,
    const_root,
)
from ...lower.groups import Lowered, k_blocks
from ...lower.kernel import Kernel
from ...rewrite.layout import has_format, is_channels_last
from ...runtime.execute import pack_frozen
from ...runtime.finite import FiniteGuard, gain, largest
from ...runtime.plan import Built, BuiltCall, BuiltGemm, BuiltKernel
from ..base import Make, Module, Unavailable
from .build import BuildError, Library, build
from .depthwise import OWN_DEPTHWISE, pack_filters, render_depthwise, render_dw_gemm
from .gemm import (
    GEMM_RANGES,
    GEMM_TYPES,
    OWN_GEMM,
    OwnPack,
    blas,
    can_pack,
    gemm_ranges,
    own_layout,
    pack_layout,
    pack_weight,
    render_gemm,
)
from .render import render_module
from .small_conv import OWN_SMALL_CONV, pack_dense
from .winograd import OWN_WINOGRAD, pack_winograd, render_winograd


def build_module(graph: Graph, lowered: Lowered) -> Module:
    return build_modules([(graph, lowered)])[0]


@dataclasses.dataclass
class _Named:
    """One graph's candidates by kernel name: what build_modules renders and binds."""

    names: dict[tuple[int, str], str] = dataclasses.field(default_factory=dict)
    kernels: list[tuple[str, Kernel]] = dataclasses.field(default_factory=list)
    gemms: list[tuple[str, GemmKernel, list[int] | None]] = dataclasses.field(default_factory=list)
    depthwise: list[tuple[str, DepthwiseKernel]] = dataclasses.field(default_factory=list)
    dw_gemms: list[tuple[str, DwGemmKernel]] = dataclasses.field(default_factory=list)
    layouts: dict[tuple[int, str], tuple[list[int], int]] = dataclasses.field(
        default_factory=dict
    )  # MKL's packed GEMM weights


def _name(lowered: Lowered, tag: str) -> _Named:
    out = _Named()
    for gid, cands in lowered.candidates.items():
        for cname, c in cands.items():
            if isinstance(c, Kernel):
                name = f"{c.name}_{gid}" if cname == "kernel" else f"{c.name}_{cname}_{gid}"
                out.names[(gid, cname)] = tag + name
                out.kernels.append((tag + name, c))
            elif isinstance(c, DepthwiseKernel):
                name = f"{tag}{c.name}_{c.implementation.replace('-', '_')}_{gid}"
                out.names[(gid, cname)] = name
                out.depthwise.append((name, c))
            elif isinstance(c, DwGemmKernel):
                name = f"{tag}{c.name}_{c.implementation.replace('-', '_')}_{gid}"
                out.names[(gid, cname)] = name
                out.dw_gemms.append((name, c))
            elif isinstance(c, GemmKernel):
                offsets = None
                if c.own:  # the rendered kernel's offsets (OwnPack derives the same);
                    # none where the kernel packs B itself
                    offsets = None if c.packs_b else own_layout(c)[0]
                elif c.spec.packable and can_pack():
                    offsets, total = pack_layout(c)
                    out.layouts[(gid, cname)] = (offsets, total)
                name = f"{tag}{c.name}_{cname.replace('-', '_')}_{gid}"
                out.names[(gid, cname)] = name
                out.gemms.append((name, c, offsets))
        for cname, c in cands.items():  # the same epilogue kernel as "unfused"
            if isinstance(c, PackedThenKernel) and (gid, "unfused") in out.names:
                out.names[(gid, cname)] = out.names[(gid, "unfused")]
    return out


def build_modules(parts: Sequence[tuple[Graph, Lowered]]) -> list[Module]:
    """The kernels of several graphs built as one library (one compiler run): the static
    regions of a graph with symbolic sizes compile together. A Module per graph."""
    named = [_name(lowered, f"g{i}_" if i else "") for i, (_, lowered) in enumerate(parts)]
    header = GEMM_TYPES if any(nm.gemms for nm in named) else ""
    winograd = any(d.winograd is not None for nm in named for _, d in nm.depthwise)
    if (
        any(k.own for nm in named for _, k, _ in nm.gemms)
        or any(nm.dw_gemms for nm in named)
        or winograd
    ):
        if any(gemm_ranges(k) for nm in named for _, k, _ in nm.gemms):
            header += GEMM_RANGES
        header += OWN_GEMM
    if any(not d.dense for nm in named for _, d in nm.depthwise) or any(
        nm.dw_gemms for nm in named
    ):
        header += OWN_DEPTHWISE
    if any(d.dense and d.winograd is None for nm in named for _, d in nm.depthwise):
        header += OWN_SMALL_CONV
    if winograd:
        header += OWN_WINOGRAD
    # Sizes printed as expressions first; should that source fail, as values (the form every
    # graph with static sizes takes).
    for symbolic in (True, False):
        valued: set[str] = set()  # kernels that printed a Size as its value
        rendered, sized = _render(named, symbolic, valued)
        # The layers of a deep model repeat the same kernels: compile each distinct one
        # once (gcc time grows with the translation unit), and let equal candidates share
        # it. A kernel's text without its own name is also its name-free signature (below).
        canonical = {name: text.replace(name, "KERNEL") for name, text in rendered.items()}
        # canonical text and size values -> the name that defines it: one text read with
        # other values would be another kernel (ir/size.py: each kernel is passed the
        # values of the Sizes it printed)
        first: dict[tuple[str, Any], str] = {}
        alias = {
            name: first.setdefault((text, tuple(map(value, sized[name]))), name)
            for name, text in canonical.items()
        }
        pieces = [rendered[n] for n in first.values()]
        lib = None
        cached, problem = True, ""
        missing: set[str] = set()  # kernels the compiler rejected: their groups run with torch
        if pieces:
            try:
                lib = build(pieces, header)
                cached = lib.cached
            except BuildError as e:
                problem = f"opfuse: kernels could not be built, running those ops with torch ({e})"
            if lib is not None and lib.rejected:
                defined = list(first.values())
                missing = {defined[i] for i in lib.rejected}
                problem = (
                    f"opfuse: {len(missing)} of {len(defined)} kernels could not be built "
                    f"({', '.join(sorted(missing))}), running those ops with torch "
                    f"({lib.problem})"
                )
                if lib.handle is None:
                    lib = None
        if not problem or not any(sized.values()):
            break
    modules = []
    shared = hashlib.sha256(header.encode()).hexdigest()[:16]
    for (graph, lowered), nm in zip(parts, named):
        names = {key: alias[n] for key, n in nm.names.items()}
        used = set(names.values())
        mine = [rendered[n] for n in first.values() if n in used]
        mod = Module(header + "\n".join(mine), cached=cached)
        mod.problem = problem
        # every Size of every kernel printed as its expression: the library computes any
        # size whose decisions come out the same (runtime/sized.py)
        mod.generic = symbolic and not any(alias[n] in used for n in valued)
        for gid, cands in lowered.candidates.items():
            # the code the kernels share (opfuse's GEMM, its depthwise kernel): a tuning
            # decision made with another version of it is not this one's
            sig = [f"shared:{shared}"]
            for cname, c in sorted(cands.items()):
                kname = names.get((gid, cname))
                if kname:
                    text = canonical[kname]
                else:  # sizes as symbols: every size takes the first size's choice
                    with symbolic_text():
                        text = _describe(c)
                sig.append(f"{cname}:{text}")
            mod.signatures[gid] = sig
        _bind(mod, graph, lowered, names, nm.layouts, lib, missing, sized)
        modules.append(mod)
    return modules


def _render(
    named: Sequence[_Named], symbolic: bool, valued: set[str]
) -> tuple[dict[str, str], dict[str, Any]]:
    """Each kernel's C by name, and the size symbols it takes (none unless `symbolic`);
    the kernels that printed a Size as its value go into `valued`."""
    rendered: dict[str, str] = {}
    sized: dict[str, tuple[int, ...]] = {}
    for nm in named:
        for name, k in nm.kernels:
            render = functools.partial(render_module, [(name, k)])
            rendered[name], sized[name] = (
                _sized(name, render, len(k.buffers), valued) if symbolic else (render(), ())
            )
        tiled: list[tuple[str, GemmKernel | DepthwiseKernel | DwGemmKernel, Callable[[], str]]]
        tiled = [(n, g, functools.partial(render_gemm, n, g, o)) for n, g, o in nm.gemms]
        for n, d in nm.depthwise:
            draw = render_depthwise if d.winograd is None else render_winograd
            tiled.append((n, d, functools.partial(draw, n, d)))
        tiled += [
            (n, d, functools.partial(render_dw_gemm, n, d, own_layout(d.gemm)[1] if d.gemm else 0))
            for n, d in nm.dw_gemms
        ]
        for n, g, text in tiled:
            rendered[n], sized[n] = (
                _sized(n, text, 3 + len(g.epilogue.buffers), valued) if symbolic else (text(), ())
            )
    return rendered, sized


def _sized(
    name: str, render: Callable[[], str], first: int, valued: set[str]
) -> tuple[str, tuple[int, ...]]:
    """A kernel's C with its Sizes printed as expressions of the graph's size symbols
    (ir/size.py), which it reads from its arguments after its own `first` ones; and the
    symbols at this size (Sizes of one symbol each), in that order. Every size of a graph
    then renders the same text wherever its decisions came out the same, built once."""
    with symbolic_text() as seen:
        text = render()
    if seen.valued:
        valued.add(name)
    if not seen:
        return text, ()
    symbols = sorted(seen)
    head = f"int {name}(void *const *args, int nthreads) {{"
    assert head in text, head
    reads = "".join(
        f"\n  const int64_t {s} = (int64_t)(intptr_t)args[{first + j}];"
        for j, s in enumerate(symbols)
    )
    sizes = tuple(Size(seen[s], s, ((s, seen[s]),)) for s in symbols)
    return text.replace(head, head + reads, 1), sizes


def _bind(
    mod: Module,
    graph: Graph,
    lowered: Lowered,
    names: dict[tuple[int, str], str],
    layouts: dict[tuple[int, str], tuple[list[int], int]],
    lib: Library | None,
    missing: set[str],
    sized: dict[str, tuple[int, ...]],
) -> None:
    """How to make each candidate of each group, from the built library."""
    b = blas()
    for gid, cands in lowered.candidates.items():
        makers: dict[str, Make] = {}
        for cname, c in cands.items():
            name = names.get((gid, cname), "")
            sizes = sized.get(name, ())
            if c is None:
                makers[cname] = _torch_runs
            elif isinstance(c, OneDnnPlan):
                makers[cname] = functools.partial(_make_library_call, graph, c, cname)
            elif lib is None or name in missing:
                continue
            elif isinstance(c, Kernel):
                makers[cname] = functools.partial(BuiltKernel, c, lib.fn(name), sizes=sizes)
            elif isinstance(c, PackedThenKernel) and name:
                makers[cname] = functools.partial(_make_packed_then, graph, c, lib.fn(name), sizes)
            elif isinstance(c, DepthwiseKernel):
                makers[cname] = functools.partial(_make_depthwise, graph, c, lib.fn(name), sizes)
            elif isinstance(c, DwGemmKernel):
                makers[cname] = functools.partial(_make_dw_gemm, graph, c, lib.fn(name), sizes)
                mod.absorbs[(gid, cname)] = c.producers
            elif isinstance(c, GemmKernel) and c.own:
                makers[cname] = functools.partial(_make_own_gemm, graph, c, lib.fn(name), sizes)
            elif isinstance(c, GemmKernel) and b is not None:
                layout = layouts.get((gid, cname))
                fn_addr = b.sgemm_compute if layout is not None else b.sgemm
                assert fn_addr is not None
                makers[cname] = functools.partial(
                    _make_gemm, graph, c, lib.fn(name), layout, fn_addr, sizes
                )
        mod.candidates[gid] = makers


def _torch_runs() -> None:
    return None


def _make_library_call(graph: Graph, c: OneDnnPlan, cname: str) -> Built:
    linear = _LINEAR_CALLS.get(cname)
    try:
        if linear is not None:
            call = linear(graph, c)
        else:
            call = onednn_call(graph, c, channels_last=cname.endswith("nhwc"))
    except RuntimeError as e:  # oneDNN refuses this dtype or layout
        raise Unavailable(str(e)) from e
    if call is None:
        raise Unavailable(f"{cname} cannot run {c.anchor.name}")
    return call


def _make_packed_then(
    graph: Graph, c: PackedThenKernel, fn: Any, sizes: tuple[int, ...] = ()
) -> Built:
    plain = OneDnnPlan(c.anchor, c.anchor)
    try:
        first = _LINEAR_CALLS.get(c.library, _linear_call)(graph, plain)
    except RuntimeError as e:  # oneDNN refuses this dtype or layout
        raise Unavailable(str(e)) from e
    if first is None:
        raise Unavailable(f"no packed {c.library} GEMM for {c.anchor.name}")
    return BuiltKernel(c.kernel, fn, first, sizes)


def _make_gemm(
    graph: Graph,
    c: GemmKernel,
    fn: Any,
    layout: tuple[list[int], int] | None,
    fn_addr: int,
    sizes: tuple[int, ...] = (),
) -> Built:
    packed = pack_weight(c, _weight(graph, c), *layout) if layout is not None else None
    return BuiltGemm(c, fn, packed, fn_addr, sizes=sizes)


def _make_own_gemm(graph: Graph, c: GemmKernel, fn: Any, sizes: tuple[int, ...] = ()) -> Built:
    """opfuse's GEMM (no library function): a frozen weight packed now; a parameter the
    graph takes as an input packed by the runtime on the first call, and again when it
    changes; any other B packed by the kernel on every call."""
    if c.packs_b:
        return BuiltGemm(c, fn, None, 0, sizes=sizes)
    if c.spec.packable:
        return BuiltGemm(c, fn, pack_frozen(OwnPack.of(c), _weight(graph, c)), 0, sizes=sizes)
    return BuiltGemm(c, fn, None, 0, OwnPack.of(c), sizes=sizes)


def _make_depthwise(
    graph: Graph, k: DepthwiseKernel, fn: Any, sizes: tuple[int, ...] = ()
) -> Built:
    """opfuse's depthwise kernel, its frozen filters (and bias) packed now."""
    return BuiltGemm(k, fn, _filters(graph, k), 0, sizes=sizes)


def _filters(graph: Graph, k: DepthwiseKernel) -> torch.Tensor:
    """A depthwise (or few-channel) kernel's frozen filters and bias, packed as it reads
    them."""
    weight = _const(graph, k.weight)
    bias = _const(graph, k.bias)
    assert weight is not None and (bias is not None or k.bias is None)
    if k.winograd is not None:
        return pack_winograd(weight, bias)
    return (pack_dense if k.dense else pack_filters)(weight, bias)


def _make_dw_gemm(graph: Graph, k: DwGemmKernel, fn: Any, sizes: tuple[int, ...] = ()) -> Built:
    """A depthwise convolution feeding a matmul: the filters and bias packed as the
    depthwise kernel reads them, then the matmul's weight as opfuse's GEMM does (and the
    expansion's, where the kernel computes the depthwise input too)."""
    parts = [_filters(graph, k.dw)]
    if k.gemm is not None:
        parts.append(OwnPack.of(k.gemm)(_weight(graph, k.gemm)))
    if k.expand is not None:  # (the expansion's weight after the matmul's)
        parts.append(OwnPack.of(k.expand)(_weight(graph, k.expand)))
    return BuiltGemm(k, fn, torch.cat(parts), 0, sizes=sizes)


def _weight(graph: Graph, k: GemmKernel) -> torch.Tensor:
    t = _const(graph, k.spec.b.node)
    assert t is not None
    return t


# -- oneDNN --------------------------------------------------------------------------------------
def onednn_call(graph: Graph, plan: OneDnnPlan, channels_last: bool = False) -> BuiltCall | None:
    a = plan.anchor
    if a.op == "aten.convolution.default" and plan.output.tensor.ndim == 2:
        return _rows(_conv_call(graph, dataclasses.replace(plan, output=a), True), plan.output)
    if a.op == "aten.convolution.default":
        return _conv_call(graph, plan, channels_last)
    return _linear_call(graph, plan)


def _rows(call: BuiltCall | None, matmul: Node) -> BuiltCall | None:
    """A convolution run for the rows that stand for it (rewrite/conv_rows.py: a 1x1
    one's matmul, a depthwise one's rows), its NHWC result returned as those rows: a
    view, no copy."""
    if call is None:
        return None
    rows = list(matmul.tensor.shape)

    def as_rows(conv: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda *xs: conv(*xs).permute(0, 2, 3, 1).view(rows)

    guard = call.guard
    if guard is not None and guard.exact is not None:
        guard = dataclasses.replace(guard, exact=as_rows(guard.exact))
    return dataclasses.replace(call, call=as_rows(call.call), output=matmul, guard=guard)


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
    rows = x.tensor.shape[0]
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    op = torch.ops.mkl._mkl_linear

    def call(xv: torch.Tensor) -> torch.Tensor:
        return op(xv, packed, weight, bias, rows)

    return BuiltCall(call, [x], plan.output, library="mkl")


def _frozen_linear(
    graph: Graph, anchor: Node
) -> tuple[Node, torch.Tensor, torch.Tensor | None] | None:
    """(input, weight as nn.Linear holds it [out, in], 1-D bias or None) of an addmm / mm
    whose weight and bias are frozen constants and which scales nothing; else None."""
    a = bind(anchor)
    addmm = anchor.op == "aten.addmm.default"
    x = a["mat1"] if addmm else a["self"]
    w_t = _const(graph, a["mat2"])
    if w_t is None:
        return None
    bias = _const(graph, a.get("self")) if addmm else None
    if addmm and (bias is None or a.get("alpha", 1) != 1 or a.get("beta", 1) != 1):
        return None
    if bias is not None and bias.ndim != 1:
        return None
    return x, w_t.t().contiguous(), bias


def _const(graph: Graph, n: Node | None) -> torch.Tensor | None:
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


def _linear_call(graph: Graph, plan: OneDnnPlan) -> BuiltCall | None:
    frozen = _frozen_linear(graph, plan.anchor)  # oneDNN takes the [out, in] layout
    if frozen is None:
        return None
    x, weight, bias = frozen
    out_shape = plan.output.tensor.shape
    n = weight.shape[0]
    guard = _guard(plan, weight, bias)
    weight = _packed_for_onednn(weight, x.tensor.shape[0])
    op = torch.ops.mkldnn._linear_pointwise
    if plan.binary is None:

        def make(attr: str | None) -> Callable[..., torch.Tensor]:
            scalars, alg = list(plan.scalars) if attr else [], plan.algorithm if attr else None

            def call(xv: torch.Tensor) -> torch.Tensor:
                return op(xv, weight, bias, attr or "none", scalars, alg).view(out_shape)

            return call

        return BuiltCall(make(plan.unary), [x], plan.output, guard=_exact(guard, plan, make))
    assert plan.other is not None
    battr = plan.binary

    def call2(xv: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return op.binary(xv, other.reshape(-1, n), weight, bias, battr).view(out_shape)

    return BuiltCall(call2, [x, plan.other], plan.output, guard=guard)


def chunked_linear_call(graph: Graph, plan: OneDnnPlan) -> BuiltCall | None:
    """x @ w.T + b as oneDNN's float32 GEMM over K in blocks (lower/groups.k_blocks): the
    first block's call adds the bias, each next one adds its product onto the result so far
    (oneDNN's binary-add post-op). oneDNN's one call sums K in one chain, 2-2.5x further
    from float64 than MKL's; in blocks it is as close as MKL's (lower/groups.K_BLOCK)."""
    frozen = _frozen_linear(graph, plan.anchor)
    if frozen is None:
        return None
    x, weight, bias = frozen
    rows, k = x.tensor.shape[0], weight.shape[1]
    cuts = k_blocks(k)
    blocks = [_packed_for_onednn(weight[:, lo:hi].contiguous(), rows) for lo, hi in cuts]
    op = torch.ops.mkldnn._linear_pointwise

    def call(xv: torch.Tensor) -> torch.Tensor:
        (lo, hi), first = cuts[0], blocks[0]
        out = op(xv[:, lo:hi], first, bias, "none", [], "")
        for (lo, hi), w in zip(cuts[1:], blocks[1:]):
            out = op.binary(xv[:, lo:hi], out, w, None, "add")
        return out

    return BuiltCall(call, [x], plan.output, library="onednn-kblocks")


# The packed linears other than oneDNN's one call, by candidate (or PackedThenKernel
# library) name.
_LINEAR_CALLS: dict[str, Callable[[Graph, OneDnnPlan], BuiltCall | None]] = {
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
    weight = _const(graph, w)
    bias = _const(graph, b) if b is not None else None
    if weight is None or (b is not None and bias is None) or a["transposed"]:
        return None
    stride, padding, dilation, groups = (
        list(a["stride"]),
        list(a["padding"]),
        list(a["dilation"]),
        a["groups"],
    )
    dims = weight.ndim - 2
    out_meta = plan.output.tensor
    channels_last = channels_last or is_channels_last(out_meta)  # NHWC graph: stay NHWC
    if channels_last and dims not in (2, 3):
        return None
    packed: Any = weight
    if channels_last:
        # Prepacked (blocked) weights make oneDNN write NHWC; with NCHW wanted the plain
        # weight is faster than a packed convolution plus a copy back.
        packed = _prepack(weight, dims, a, list(x.tensor.shape))
    cl = torch.channels_last if dims == 2 else torch.channels_last_3d
    fmt = cl if channels_last else None
    # oneDNN picks its output layout itself (NHWC for few channels even from NCHW input);
    # callers and the memory plan expect the layout the graph inferred.
    want = torch.contiguous_format if out_meta.is_contiguous() else cl
    op = torch.ops.mkldnn._convolution_pointwise
    guard = _guard(plan, weight, bias)
    shape_args: tuple[Any, ...] = (packed, bias, padding, stride, dilation, groups)

    def to_fmt(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous(memory_format=cl)  # (used only where fmt is cl)

    def same(t: torch.Tensor) -> torch.Tensor:
        return t

    def prep_for(n: Node) -> Callable[[torch.Tensor], torch.Tensor]:
        # A value the graph already lays out as oneDNN wants (NHWC between convolutions)
        # skips the per-call check (MobileNetV2 b1: 51 calls, ~2 us each). One that comes
        # out otherwise all the same is still correct: oneDNN takes any strides.
        return to_fmt if fmt is not None and not has_format(n.tensor, fmt) else same

    prep, prep_other = prep_for(x), prep_for(plan.other) if plan.other is not None else same

    def fix(y: torch.Tensor) -> torch.Tensor:
        return y if y.is_contiguous(memory_format=want) else y.contiguous(memory_format=want)

    if plan.binary is None:

        def make(attr: str | None) -> Callable[..., torch.Tensor]:
            scalars, alg = list(plan.scalars) if attr else [], plan.algorithm if attr else None

            def call(xv: torch.Tensor) -> torch.Tensor:
                return fix(op(prep(xv), *shape_args, attr or "none", scalars, alg))

            return call

        return BuiltCall(make(plan.unary), [x], plan.output, guard=_exact(guard, plan, make))

    def make2(attr: str | None) -> Callable[..., torch.Tensor]:
        rest: tuple[Any, ...] = (*shape_args, plan.binary, 1.0, attr, [], None)

        def call2(xv: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
            return fix(op.binary(prep(xv), prep_other(other), *rest))

        return call2

    call2, guard = make2(plan.unary), _exact(guard, plan, make2)
    assert plan.other is not None
    if plan.binary != "add" or fmt != (cl if want is cl else None):
        return BuiltCall(call2, [x, plan.other], plan.output, guard=guard)
    # oneDNN's sum post-op accumulates into `other` itself: when the residual is dead after
    # the conv (ResNet's block tail) no output is allocated and one pass over memory saved.
    op_ = torch.ops.mkldnn._convolution_pointwise_
    rest: tuple[Any, ...] = (*shape_args, plan.binary, 1.0, plan.unary, [], None)

    def call2_(xv: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return op_.binary(other, prep(xv), *rest)

    return BuiltCall(call2, [x, plan.other], plan.output, inplace=call2_, donor=1, guard=guard)


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


def _exact(
    guard: FiniteGuard | None, plan: OneDnnPlan, make: Callable[[str | None], Callable[..., Any]]
) -> FiniteGuard | None:
    """The guard of a call whose post-op erases NaN gets the exact path: `make(None)` (the
    call without its post-op), then torch's post-op."""
    if guard is None or plan.unary not in ERASES_NAN:
        return guard
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


def _describe(c: object) -> str:
    """A name-free description of a library candidate (oneDNN call or torch op)."""
    if isinstance(c, OneDnnPlan):
        nodes = [c.anchor, c.output] + ([c.other] if c.other is not None else [])
        metas = [(n.op, n.meta) for n in nodes]
        args = {k: (v.meta if isinstance(v, Node) else v) for k, v in bind(c.anchor).items()}
        return f"{metas} {args} {c.unary} {c.scalars} {c.algorithm} {c.binary}"
    return repr(c)
