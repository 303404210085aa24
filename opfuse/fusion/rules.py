"""When two groups may become one kernel: every rule in one place, each refusal a reason in
words (Inductor's WhyNoFuse). The partitioner (partition.py) decides which merges to try
and in which order; these functions only answer "may it?".

    can_fuse(groups, a, b, lowerable)          two pointwise/reduction groups: one kernel?
    can_take_epilogue(groups, anchor, lowerable)  a matmul/conv and the group reading it?

The structural rules (size, reductions over one domain, no cycle, what an epilogue may
contain) are answered here from the graph. What only the lowering knows -- every value can
be computed at the positions the kernel visits, outputs cover its domain -- it answers
through `lowerable`, a callback that builds the kernel's values but no schedule
(lower/lowering.why_not_lowered). fusion/ imports nothing from lower/.

The cycle rule's tricky case is a diamond whose sides are not both in the group:

        a ----> b (group G)
        |       |
        +--> c (opaque) --> d

Merging d into G would make G read c, which reads G: a cycle. `creates_cycle` finds the
path G -> c -> d through a node outside both groups.

The path may also run through a third group at two different members (two branches that
exchange values, HRNet's fuse layers):

        a --> add1 (G1)         G1 = {a, add1}, G2 = {b, add2}
        a --> mm_q --> add2     merging mm_p into G1 (its epilogue) makes G1 read b, in G2,
        b --> add2 (G2)         while G2 reads mm_q, which reads G1: a cycle between groups
        b --> mm_p --> add1     that no path between single nodes shows.

So the search walks groups: reaching any member of a group continues from all its members.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from ..ir.graph import GETITEM, Graph, Node, TensorMeta
from ..ir.ops import Kind, info, mismatched_reductions, short
from ..ir.uses import used_outside

MAX_GROUP_NODES = 256


class Lowerable(Protocol):
    """The lowering's answer: why `members` cannot be one kernel, or None."""

    def __call__(self, graph: Graph, members: Sequence[Node], /) -> str | None: ...


class Groups(Protocol):
    """What the rules read of a partition being built."""

    g: Graph
    kinds: dict[Node, Kind]
    group_of: dict[Node, int]
    members: dict[int, list[Node]]
    index: dict[Node, int]

    def roots(self, n: Node) -> list[Node]: ...


def can_fuse(s: Groups, a: int, b: int, lowerable: Lowerable) -> str | None:
    """May groups a and b (pointwise ops and reductions) run as one kernel?"""
    A, B = s.members[a], s.members[b]
    if len(A) + len(B) > MAX_GROUP_NODES:
        return f"the group would exceed {MAX_GROUP_NODES} ops"
    if creates_cycle(s, set(A), set(B)):
        return "fusing would create a cycle through an op outside both groups"
    # A kernel's reductions reduce the same dims of the same shape (its loop nest).
    reds = sorted((n for n in A + B if s.kinds.get(n) == Kind.REDUCTION), key=s.index.__getitem__)
    return mismatched_reductions(reds) or lowerable(s.g, A + B)


def epilogue_consumers(s: Groups, anchor: Node) -> list[Node]:
    """The ops that read a matmul/conv result, looking through the views it passes."""
    out: list[Node] = []
    stack = list(s.g.users[anchor])
    while stack:
        u = stack.pop()
        if s.kinds.get(u) == Kind.INJECTIVE and u.op != GETITEM and not info(u.op).copies:
            stack.extend(s.g.users[u])
            if u in s.g.output_set:
                out.append(u)
        elif u not in out:
            out.append(u)
    return sorted(out, key=s.index.__getitem__)


def can_take_epilogue(
    s: Groups, anchor: Node, consumers: list[Node], lowerable: Lowerable
) -> tuple[Node, str] | None:
    """May the matmul/conv `anchor` (a group of its own) take the group that reads its
    result as its epilogue? A refusal names the consumer it concerns."""
    groups = {s.group_of.get(c) for c in consumers}
    fusable = [c for c in consumers if fusable_kind(s.kinds.get(c))]
    what = "convolution" if "convolution" in anchor.op else anchor.op.split(".")[1]
    if len(groups) != 1 or len(fusable) != len(consumers):
        other = next(
            c
            for c in consumers
            if c not in fusable or s.group_of.get(c) != s.group_of.get(consumers[0])
        )
        if len(consumers) == 1:
            return other, f"{what} output feeds {short(other.op)} (not an elementwise op)"
        return other, f"{what} output has {len(consumers)} users in different kernels"
    epi = s.members[s.group_of[consumers[0]]]
    red = next((m for m in epi if s.kinds.get(m) == Kind.REDUCTION), None)
    if red is not None:
        op, rop = short(consumers[0].op), short(red.op)
        via = "" if op == rop else f" through {op}"
        return consumers[0], f"{what} output feeds a reduction ({rop}){via}"
    if creates_cycle(s, {anchor}, set(epi)):
        return consumers[0], "fusing would create a cycle through an op outside both groups"
    why = _epilogue_shape(s.g, anchor, [anchor, *epi]) or lowerable(s.g, epi)
    # (the epilogue alone must lower: run after the library call, it is every
    # epilogue group's fallback)
    return (consumers[0], why) if why else None


def _epilogue_shape(graph: Graph, anchor: Node, members: list[Node]) -> str | None:
    """An epilogue is pointwise, keeps the anchor's result inside, and stores only values
    of the anchor's size (it runs over the anchor's output, element by element)."""
    inside = set(members)
    outs = [m for m in members if used_outside(graph, m, inside)]
    what = anchor.op.split(".")[1]
    if anchor in outs:
        return f"{what} output is also read outside the epilogue"
    for m in members:
        if m is not anchor and not info(m.op).pointwise:
            return f"{m.op} cannot run in an epilogue"
    numel = anchor.tensor.numel
    for o in outs:
        if not isinstance(o.meta, TensorMeta) or o.tensor.numel != numel:
            return f"epilogue output {o.name} is not the size of the {what} output"
    return None


def fusable_kind(k: Kind | None) -> bool:
    """Ops a generated kernel computes: pointwise, broadcast, reductions."""
    return k is not None and (k <= Kind.BROADCAST or k == Kind.REDUCTION)


def creates_cycle(s: Groups, A: set[Node], B: set[Node]) -> bool:
    return _reaches(s, A, B) or _reaches(s, B, A)


def _reaches(s: Groups, src: set[Node], dst: set[Node]) -> bool:
    """Is there a path src -> x -> dst with x outside both sets? Paths run between groups,
    not nodes: a group is one kernel, so a path that enters a group at one member leaves it
    from every member (see the module docstring's second diagram)."""
    lo = min(s.index[n] for n in src)
    stack = [x for x in _preds(s, dst) if x not in src and x not in dst]
    seen: set[Node] = set()
    entered: set[int] = set()
    while stack:
        x = stack.pop()
        if x in seen or x in dst:
            continue
        seen.add(x)
        if x in src:
            return True
        gid = s.group_of.get(x)
        if gid is None:
            if s.index[x] >= lo:
                stack.extend(_preds(s, [x]))
        elif gid not in entered:
            entered.add(gid)
            # members are in topological order: a group that ends before src begins
            # cannot read it
            if s.index[s.members[gid][-1]] >= lo:
                stack.extend(_preds(s, s.members[gid]))
    return False


def _preds(s: Groups, nodes: Iterable[Node]) -> list[Node]:
    return [r for n in nodes for i in n.inputs() for r in s.roots(i)]
