"""What a well-formed Graph is, checked: run after every pass under the tests (Options.verify,
OPFUSE_VERIFY=1), so a pass that breaks the graph is named where it does, not three passes
later as a wrong number."""

from __future__ import annotations

from typing import Any

from .graph import CONSTANT, GETITEM, INPUT, Graph, Node, TensorMeta
from .printer import format_node


class InvalidGraph(AssertionError):
    """The graph breaks an invariant; the message lists every problem found."""


def verify(graph: Graph, after: str = "") -> None:
    problems = list(_problems(graph))
    if problems:
        where = f" after {after}" if after else ""
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise InvalidGraph(f"invalid graph{where}:\n  {shown}{more}")


def _problems(graph: Graph) -> Any:
    seen: set[Node] = set()
    names: set[str] = set()
    inputs = set(graph.inputs)
    for n in graph.nodes:
        if n.name in names:
            yield f"two values are named %{n.name}"
        names.add(n.name)
        for i in n.inputs():
            if i not in seen:
                yield f"{format_node(n)}: reads %{i.name}, not defined before it in this graph"
        if n.op == INPUT and n not in inputs:
            yield f"%{n.name} is an input node but not among the graph's inputs"
        if n.op == CONSTANT:
            yield from _constant(graph, n)
        if n.op == GETITEM:
            yield from _getitem(n)
        yield from _meta(n)
        seen.add(n)
    for i in graph.inputs:
        if i not in seen or i.op != INPUT:
            yield f"graph input %{i.name} is not an input node of the graph"
    for o in graph.outputs:
        if isinstance(o, Node) and o not in seen:
            yield f"output %{o.name} is not a node of the graph"
    unused = set(graph.constants) - {n.name for n in graph.nodes if n.op == CONSTANT}
    if unused:
        yield f"constants without a node: {sorted(unused)[:5]}"


def _constant(graph: Graph, n: Node) -> Any:
    t = graph.constants.get(n.name)
    if t is None:
        yield f"constant %{n.name} has no tensor"
    elif not isinstance(n.meta, TensorMeta) or (
        tuple(t.shape) != n.meta.shape or t.dtype != n.meta.dtype
    ):
        yield f"constant %{n.name}: its tensor is {t.dtype}{list(t.shape)}, its type says {n.meta}"


def _getitem(n: Node) -> Any:
    src, k = n.args[0], n.args[1] if len(n.args) > 1 else None
    if not isinstance(src, Node) or not isinstance(src.meta, tuple):
        yield f"{format_node(n)}: takes an item of a value that is not a tuple"
    elif not isinstance(k, int) or not -len(src.meta) <= k < len(src.meta):
        yield f"{format_node(n)}: item {k!r} of a {len(src.meta)}-tuple"
    elif src.meta[k] != n.meta:
        yield f"{format_node(n)}: its type is not item {k} of %{src.name}'s"


def _meta(n: Node) -> Any:
    metas = n.meta if isinstance(n.meta, tuple) else (n.meta,)
    for m in metas:
        if not isinstance(m, TensorMeta):
            continue
        if len(m.shape) != len(m.stride):
            yield f"{format_node(n)}: {len(m.shape)} sizes but {len(m.stride)} strides"
        if any(not isinstance(s, int) or s < 0 for s in m.shape):
            yield f"{format_node(n)}: sizes {m.shape} are not counts"
