"""Build the FusionReport of a compiled graph from the decisions the compiler made."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..fusion.groups import Group, Partition, Pattern
from ..ir.graph import CONSTANT, GETITEM, INPUT, Graph, Node, TensorMeta
from ..ir.ops import VIEW_OPS, Kind, info, short
from ..lower.epilogue import GemmKernel
from ..lower.groups import Lowered
from ..lower.kernel import Kernel
from ..runtime.plan import Absorbed, Built, BuiltCall, BuiltGemm, BuiltKernel
from .tables import EdgeReport, FusionReport, GroupReport, RejectReport


def count_kernels(graph: Graph) -> int:
    """Compute kernels eager would launch for this graph: one per op, views excluded."""
    return sum(1 for n in graph.nodes if is_compute(n))


def is_compute(n: Node) -> bool:
    if n.op in (INPUT, CONSTANT, GETITEM):
        return False
    return n.op not in VIEW_OPS


def make_report(
    graph: Graph,
    part: Partition,
    lowered: Lowered,
    built: Mapping[int, Built],
    decisions: Mapping[int, Any],
    eager_kernels: int | None,
    source: str,
    copied: Sequence[Node] = (),
) -> FusionReport:
    """The report of one compiled graph. `copied`: data-movement ops (cat, pad, flip, ...)
    that no kernel reads through, which the plan runs with torch."""
    groups: list[GroupReport] = []
    owned = {n for g in part.groups for n in g.nodes} | set(copied)  # (torch copies them)
    bytes_before = bytes_after = 0
    launches = 0
    for g in part.groups:
        b = built.get(g.id)
        pattern, reason = g.pattern, g.reason
        if b is None and (pattern.generated or pattern.epilogue):
            pattern = Pattern.FALLBACK
            reason = reason or "kernel build failed; ran with torch"
        kernel, fused = _implementation(g, b)
        launches += _launches(g, b)
        saved = _kept_out_of_memory(graph, g) if fused else []
        if isinstance(b, Absorbed):  # nothing the group computes reaches memory
            saved = [n for n in g.nodes if isinstance(n.meta, TensorMeta)]
        modules = list(
            dict.fromkeys(n.source.module for n in g.nodes if n.source and n.source.module)
        )
        d = decisions.get(g.id)
        implementation = d.describe() if d is not None else _default_impl(g, b)
        if isinstance(b, Absorbed):
            implementation = f"inside group {b.into}'s kernel (its {implementation})"
        notes = lowered.notes.get(g.id, [])
        if notes and g.pattern.epilogue:
            implementation += " [not candidates: " + "; ".join(notes) + "]"
        if isinstance(b, BuiltCall) and b.guard is not None and b.guard.exact is not None:
            implementation += (
                " [guarded: oneDNN's post-op turns NaN into a number; it runs without it, "
                "then torch's, when an input may hold NaN or inf or a sum may overflow]"
            )
        k = _kernel_of(b)
        groups.append(
            GroupReport(
                id=g.id,
                pattern=pattern,
                kernel=kernel,
                ops=[n.op for n in g.nodes],
                nodes=[n.name for n in g.nodes],
                modules=modules,
                sources=[str(n.source) if n.source else "" for n in g.nodes],
                reason=reason,
                bytes_read=k.bytes_read if k is not None else 0,
                bytes_written=k.bytes_written if k is not None else 0,
                intermediates_saved=[n.name for n in saved],
                bytes_saved=sum(2 * n.tensor.nbytes for n in saved),
                implementation=implementation,
                source_code=_extract(source, kernel) if k is not None else "",
                reads_through=[n.op for n in _read_through(g, owned)] if fused else [],
            )
        )
        for n in g.nodes:
            if isinstance(n.meta, TensorMeta) and is_compute(n):
                # eager writes every compute op's result and reads it back at least once
                bytes_before += 2 * n.meta.nbytes
                if n not in saved:
                    bytes_after += 2 * n.meta.nbytes
    for n in copied:
        readers = ", ".join(u.name for u in graph.users[n]) or "the caller"
        groups.append(
            GroupReport(
                id=len(groups),
                pattern=Pattern.FALLBACK,
                kernel=n.op,
                ops=[n.op],
                nodes=[n.name],
                modules=[n.source.module] if n.source and n.source.module else [],
                sources=[str(n.source) if n.source else ""],
                reason=f"copied with torch: read whole by {readers} (no kernel reads through it)",
            )
        )
        launches += 1
    label = _labels(graph)
    joined = _joined(part, built)
    return FusionReport(
        kernels_before=eager_kernels if eager_kernels is not None else count_kernels(graph),
        kernels_after=launches,
        groups=groups,
        rejected=[
            RejectReport(label(r.producer), label(r.consumer), r.reason)
            for r in part.rejected
            if (r.producer, r.consumer) not in joined
        ],
        bytes_before=bytes_before,
        bytes_after=bytes_after,
        edges=_edges(graph, part),
        fusions=[[a, b] for a, b in part.fusions],
    )


def _joined(part: Partition, built: Mapping[int, Built]) -> set[tuple[str, str]]:
    """(producer, consumer) node names the partition kept apart that one kernel runs
    after all (a group absorbed into another's kernel)."""
    kernel: dict[int, list[str]] = {}  # the group whose kernel runs them -> node names
    for g in part.groups:
        b = built.get(g.id)
        if isinstance(b, Absorbed):
            kernel.setdefault(b.into, []).extend(n.name for n in g.nodes)
    for g in part.groups:
        if g.id in kernel:
            kernel[g.id].extend(n.name for n in g.nodes)
    return {(a, b) for names in kernel.values() for a in names for b in names}


def _labels(graph: Graph) -> Callable[[str], str]:
    """Node name -> what the user calls it: the module it came from (`layer1.0.conv2`), with
    the node's name where that module holds several ops (`layer1.0:relu_1`); the node's
    name where it came from no module (a function's own op)."""
    per_module: dict[str, int] = {}  # compute ops per module (views and constants aside)
    for n in graph.nodes:
        if n.source and n.source.module and is_compute(n):
            per_module[n.source.module] = per_module.get(n.source.module, 0) + 1
    names: dict[str, str] = {}
    for n in graph.nodes:
        m = n.source.module if n.source else ""
        names[n.name] = (m if per_module.get(m, 0) <= 1 else f"{m}:{n.name}") if m else n.name
    return lambda name: names.get(name, name)


def _read_through(g: Group, owned: set[Node]) -> list[Node]:
    """The copies (cat, pad, flip, ...) in no group that g's kernel computes where it reads
    them, found through views and through each other."""
    out: list[Node] = []
    stack = [i for n in g.nodes for i in n.inputs()]
    seen: set[Node] = set()
    while stack:
        n = stack.pop()
        if n in seen or n in owned or info(n.op).kind != Kind.INJECTIVE:
            continue
        seen.add(n)
        if info(n.op).copies:
            out.append(n)
        stack.extend(n.inputs())
    return sorted(out, key=lambda n: n.name)


def _edges(graph: Graph, part: Partition) -> list[EdgeReport]:
    """Tensors flowing between groups, from inputs and constants, and to the outputs.
    Views are looked through: an edge carries the tensor the producer wrote."""
    owner = {n: f"g{g.id}" for g in part.groups for n in g.nodes}

    def source(n: Node) -> tuple[str, Node]:
        while n not in owner and n.op not in (INPUT, CONSTANT) and n.inputs():
            n = n.inputs()[0]
        if n in owner:
            return owner[n], n
        return (f"input:{n.name}" if n.op == INPUT else f"const:{n.name}"), n

    seen: set[tuple[str, str]] = set()
    out: list[EdgeReport] = []

    def add(src: str, dst: str, n: Node) -> None:
        if src == dst or (src, dst) in seen or not isinstance(n.meta, TensorMeta):
            return
        seen.add((src, dst))
        out.append(
            EdgeReport(src, dst, list(n.meta.shape), str(n.meta.dtype).replace("torch.", ""))
        )

    for g in part.groups:
        for n in g.nodes:
            for i in n.inputs():
                src, root = source(i)
                if not src.startswith("const:"):
                    add(src, f"g{g.id}", root)
    for o in graph.output_set:
        src, root = source(o)
        add(src, "output", root)
    return out


def _kernel_of(b: Built | None) -> Kernel | None:
    if isinstance(b, BuiltKernel):
        return b.kernel
    if isinstance(b, BuiltGemm):
        return b.kernel.epilogue
    return None


def _implementation(g: Group, b: Built | None) -> tuple[str, bool]:
    """(what runs, whether the group's intermediates stay out of memory)."""
    if isinstance(b, Absorbed):
        return f"(in group {b.into})", True
    if isinstance(b, BuiltGemm):
        return f"{b.kernel.name}_{b.kernel.implementation.replace('-', '_')}_{g.id}", True
    if isinstance(b, BuiltCall):
        label = ", ".join(dict.fromkeys(short(n.op) for n in g.nodes))
        return f"{b.library}({label})", True
    if isinstance(b, BuiltKernel):
        name = f"{b.kernel.name}_{g.id}"
        if g.pattern.epilogue:
            how = f"{b.anchor_call.library}_unfused" if b.anchor_call is not None else "unfused"
            return f"{b.kernel.name}_{how}_{g.id}", False
        return name, True
    return ", ".join(dict.fromkeys(n.op for n in g.nodes)), False


def _launches(g: Group, b: Built | None) -> int:
    if isinstance(b, Absorbed):
        return 0
    if isinstance(b, (BuiltGemm, BuiltCall)):
        return 1
    if isinstance(b, BuiltKernel):
        return 2 if g.pattern.epilogue else 1
    return sum(1 for n in g.nodes if is_compute(n))


def _default_impl(g: Group, b: Built | None) -> str:
    if isinstance(b, BuiltCall):
        return "onednn (the only candidate)"
    if isinstance(b, BuiltGemm):
        return f"{b.kernel.implementation} (the only candidate)"
    if isinstance(b, BuiltKernel) and g.pattern.epilogue:
        return "unfused: library call, then the epilogue kernel (the only candidate)"
    return ""


def _kept_out_of_memory(graph: Graph, g: Group) -> list[Node]:
    members = set(g.nodes)
    users = graph.users
    return [
        n
        for n in g.nodes
        if isinstance(n.meta, TensorMeta)
        and n not in graph.output_set
        and all(u in members or _view_inside(u, members, users) for u in users[n])
    ]


def _view_inside(u: Node, members: set[Node], users: Mapping[Node, list[Node]]) -> bool:
    if u.op in (INPUT, CONSTANT) or info(u.op).kind != Kind.INJECTIVE:
        return False
    return all(x in members or _view_inside(x, members, users) for x in users[u])


def _extract(source: str, name: str) -> str:
    """The generated code of one kernel: C from its comment header to its closing brace;
    Triton from its comment header to the end of its launcher."""
    start = source.find(f"int {name}(")
    if start < 0:
        start = source.find(f"# {name}: ")
        end = source.find("\n    return ", start) if start >= 0 else -1
        end = source.find("\n", end + 1) if end >= 0 else -1
        return source[start : end + 1] if end >= 0 else ""
    head = source.rfind("/*", 0, start)
    end = source.find("\n}\n", start)
    return source[head if head >= 0 else start : end + 3 if end >= 0 else len(source)]


__all__ = ["GemmKernel", "count_kernels", "is_compute", "make_report"]
