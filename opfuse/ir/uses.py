"""Which values a group of nodes must store: the boundary of a kernel, as both the fusion
rules and the lowering read it."""

from __future__ import annotations

from .graph import GETITEM, Graph, Node
from .ops import Kind, info


def used_outside(graph: Graph, n: Node, members: set[Node]) -> bool:
    """Must a group of `members` store value n: is it a graph output, or read outside the
    group other than through views the group reads itself? (A tuple's components are
    asked one by one.)"""
    if n in graph.output_set:
        return True
    for u in graph.users[n]:
        if u in members:
            continue
        if info(u.op).kind == Kind.INJECTIVE and u.op != GETITEM:
            # A view read inside the group is remapped; one read outside needs n stored.
            if used_outside(graph, u, members):
                return True
            continue
        if u.op == GETITEM and isinstance(n.meta, tuple):
            continue
        return True
    return False
