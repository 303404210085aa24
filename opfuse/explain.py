"""Build the FusionReport of a compiled graph from the decisions the compiler made."""

from __future__ import annotations

from collections.abc import Mapping

from .fusion.groups import Partition
from .ir.graph import CONSTANT, GETITEM, INPUT, Graph, Node, TensorMeta
from .ir.ops import Kind, info
from .lower.kernel import Kernel
from .plan import BuiltKernel
from .report import FusionReport, GroupReport, RejectReport


def count_kernels(graph: Graph) -> int:
    """Compute kernels eager would launch for this graph: one per op, views excluded."""
    return sum(1 for n in graph.nodes if is_compute(n))


def is_compute(n: Node) -> bool:
    if n.op in (INPUT, CONSTANT, GETITEM):
        return False
    return info(n.op).kind != Kind.INJECTIVE


def make_report(
    graph: Graph,
    part: Partition,
    kernels: Mapping[int, Kernel],
    built: Mapping[int, BuiltKernel],
    eager_kernels: int | None,
    source: str,
) -> FusionReport:
    users = graph.users
    groups: list[GroupReport] = []
    bytes_before = bytes_after = 0
    for g in part.groups:
        k = kernels.get(g.id)
        is_built = g.id in built
        pattern = g.pattern
        reason = g.reason
        if k is not None and not is_built:
            pattern, reason = "fallback", reason or "kernel build failed; ran with torch"
        name = f"{k.name}_{g.id}" if (k is not None and is_built) else _op_label(g.nodes)
        members = set(g.nodes)
        saved = (
            [
                n
                for n in g.nodes
                if isinstance(n.meta, TensorMeta)
                and n not in graph.output_set
                and all(u in members or _view_inside(u, members, users) for u in users[n])
            ]
            if is_built
            else []
        )
        saved_bytes = sum(2 * n.tensor.nbytes for n in saved)
        modules = list(
            dict.fromkeys(n.source.module for n in g.nodes if n.source and n.source.module)
        )
        groups.append(
            GroupReport(
                id=g.id,
                pattern=pattern,
                kernel=name,
                ops=[n.op for n in g.nodes],
                nodes=[n.name for n in g.nodes],
                modules=modules,
                sources=[str(n.source) if n.source else "" for n in g.nodes],
                reason=reason,
                bytes_read=k.bytes_read if k is not None else 0,
                bytes_written=k.bytes_written if k is not None else 0,
                intermediates_saved=[n.name for n in saved],
                bytes_saved=saved_bytes,
                source_code=_extract(source, name) if is_built else "",
            )
        )
        for n in g.nodes:
            if isinstance(n.meta, TensorMeta) and is_compute(n):
                # eager writes every compute op's result and reads it back at least once
                bytes_before += 2 * n.meta.nbytes
        bytes_after += sum(
            2 * n.tensor.nbytes
            for n in g.nodes
            if isinstance(n.meta, TensorMeta) and n not in saved and is_compute(n)
        )
    rejected = [RejectReport(r.producer, r.consumer, r.reason) for r in part.rejected]
    return FusionReport(
        kernels_before=eager_kernels if eager_kernels is not None else count_kernels(graph),
        kernels_after=len(part.groups),
        groups=groups,
        rejected=rejected,
        bytes_before=bytes_before,
        bytes_after=bytes_after,
    )


def _view_inside(u: Node, members: set[Node], users: Mapping[Node, list[Node]]) -> bool:
    if u.op in (INPUT, CONSTANT) or info(u.op).kind != Kind.INJECTIVE:
        return False
    return all(x in members or _view_inside(x, members, users) for x in users[u])


def _op_label(nodes: list[Node]) -> str:
    return ", ".join(dict.fromkeys(n.op for n in nodes))


def _extract(source: str, name: str) -> str:
    """The generated C of one kernel (from its comment header to its closing brace)."""
    start = source.find(f"int {name}(")
    if start < 0:
        return ""
    head = source.rfind("/*", 0, start)
    end = source.find("\n}\n", start)
    return source[head if head >= 0 else start : end + 3 if end >= 0 else len(source)]
