"""All candidate kernels of a graph -> translation units -> one loaded library, and the
runnable objects (plan.Built*) for every candidate, oneDNN calls included."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...ir.graph import Graph
from ...ir.size import Size, bindings, recording, symbolic_text, unhoisted, value
from ...lower.depthwise import DepthwiseKernel
from ...lower.dw_gemm import DwGemmKernel
from ...lower.epilogue import GemmKernel, OneDnnPlan, PackedThenKernel
from ...lower.groups import Lowered
from ...lower.kernel import Kernel
from ...runtime.execute import pack_frozen
from ...runtime.plan import Built, BuiltGemm, BuiltKernel
from ..base import Make, Module, Unavailable
from .build import BuildError, Library, build
from .depthwise import OWN_DEPTHWISE, pack_filters, render_depthwise, render_dw_gemm
from .gemm import (
    GEMM_TYPES,
    OwnPack,
    blas,
    can_pack,
    pack_layout,
    pack_weight,
    render_gemm,
)
from .library import LINEAR_CALLS, constant, describe, linear_call, onednn_call
from .own_gemm import GEMM_RANGES, OWN_GEMM, gemm_ranges
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
                if not c.own and c.spec.packable and can_pack():
                    with recording(c.decided):
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
        # every Size of the kernels it runs printed as its expression: the library computes
        # any size whose decisions come out the same (runtime/sized.py)
        mod.generic = symbolic
        mod.valued = {alias[n] for n in valued} & used
        mod.kernels = {n: rendered[n] for n in first.values() if n in used}
        for gid, cands in lowered.candidates.items():
            # the code the kernels share (opfuse's GEMM, its depthwise kernel): a tuning
            # decision made with another version of it is not this one's
            sig = [f"shared:{shared}"]
            for cname, c in sorted(cands.items()):
                kname = names.get((gid, cname))
                if isinstance(c, GemmKernel) and c.decided:
                    # tiles decided on the sizes apart (for this candidate alone): one
                    # candidate at every size of the graph, whatever its tiles there
                    with symbolic_text():
                        text = f"tiled by size: {(c.name, c.ops, c.spec, c.own)!r}"
                elif kname:
                    text = canonical[kname]
                else:  # sizes as symbols: every size takes the first size's choice
                    with symbolic_text():
                        text = describe(c)
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
        for n, dg in nm.dw_gemms:
            floats = OwnPack.of(dg.gemm).total if dg.gemm else 0
            tiled.append((n, dg, functools.partial(render_dw_gemm, n, dg, floats)))
        for n, g, text in tiled:
            with recording(g.decided if isinstance(g, GemmKernel) else None):
                rendered[n], sized[n] = (
                    _sized(n, text, 3 + len(g.epilogue.buffers), valued)
                    if symbolic
                    else (text(), ())
                )
    return rendered, sized


def _sized(
    name: str, render: Callable[[], str], first: int, valued: set[str]
) -> tuple[str, tuple[int, ...]]:
    """A kernel's C with its Sizes printed as expressions of the graph's size symbols
    (ir/size.py), which it reads from its arguments after its own `first` ones; and the
    symbols at this size (Sizes of one symbol each), in that order. Every size of a graph
    then renders the same text wherever its decisions came out the same, built once."""
    with symbolic_text(hoist=True) as seen:
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
    before, body = text.split(head, 1)
    # what precedes the kernel (its comment) shows the expressions themselves
    return unhoisted(seen, before) + head + reads + bindings(seen, body) + body, sizes


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
    linear = LINEAR_CALLS.get(cname)
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
        first = LINEAR_CALLS.get(c.library, linear_call)(graph, plain)
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
    with recording(c.decided):
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
    weight = constant(graph, k.weight)
    bias = constant(graph, k.bias)
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
    t = constant(graph, k.spec.b.node)
    assert t is not None
    return t
