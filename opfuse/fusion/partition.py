"""Partition the graph into fusion groups. Decides only: emits no code.

    for node in topological order:
        pointwise / reduction node: start a group, then merge in each producer group it
            reads (through views), if the merge is legal -- vertical fusion
        matmul / conv: a library group
        anything else: a fallback group run with torch
    merge pointwise groups that read the same tensor over the same domain -- horizontal
    fusion
    each matmul / conv takes the group that reads its result as its epilogue

A merge is legal when fusion/rules.py says so (size, one reduction domain, no cycle, and
the lowering's answer through the `lowerable` callback) and fuel remains. Each refusal is
kept as a Rejection and logged on the `opfuse.fusion` logger.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from ..ir.graph import CONSTANT, GETITEM, INPUT, Graph, Node, TensorMeta
from ..ir.ops import ATTENTION, Kind, info, is_generator, reads_through, reduction_domain
from .classify import Classified
from .groups import Group, Partition, Pattern, Rejection
from .rules import Lowerable, can_fuse, can_take_epilogue, epilogue_consumers, fusable_kind

log = logging.getLogger("opfuse.fusion")


class Fuel:
    """Optimization fuel: at most `limit` fusions are performed (None: unlimited), so a
    numerical difference can be bisected to the fusion that causes it."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.used = 0

    def take(self) -> bool:
        if self.limit is not None and self.used >= self.limit:
            return False
        self.used += 1
        return True


class _Partitioner:
    def __init__(
        self, graph: Graph, classified: Classified, fuel: Fuel, lowerable: Lowerable
    ) -> None:
        self.g = graph
        self.lowerable = lowerable
        self.kinds = classified.kinds
        self.why_opaque = classified.why_opaque
        self.fuel = fuel
        self.group_of: dict[Node, int] = {}
        self.members: dict[int, list[Node]] = {}
        self.rejected: list[Rejection] = []
        self.fusions: list[tuple[str, str]] = []
        self.refused: list[tuple[Node, Node, Rejection]] = []  # vertical merges refused
        self.index = graph.index
        self._next = 0

    # -- bookkeeping ---------------------------------------------------------------------
    def _new_group(self, n: Node) -> int:
        gid = self._next
        self._next += 1
        self.members[gid] = [n]
        self.group_of[n] = gid
        return gid

    def _union(self, a: int, b: int) -> int:
        """Merge group b into group a; keep topological order of members."""
        for n in self.members[b]:
            self.group_of[n] = a
        merged = self.members[a] + self.members.pop(b)
        merged.sort(key=self.index.__getitem__)
        self.members[a] = merged
        return a

    def _fused(self, producer: str, consumer: str, how: str) -> None:
        self.fusions.append((producer, consumer))
        log.debug("fusion %d (%s): %s -> %s", len(self.fusions), how, producer, consumer)

    def _reject(self, producer: Node, consumer: Node, reason: str) -> None:
        r = Rejection(producer.name, consumer.name, reason)
        self.rejected.append(r)
        log.debug("not fused: %s", r)

    def fusable(self, n: Node) -> bool:
        return fusable_kind(self.kinds.get(n))

    def root(self, n: Node) -> Node:
        """The node whose data a value is, looking through views (getitem included)."""
        while n.op not in (INPUT, CONSTANT) and self.kinds.get(n) == Kind.INJECTIVE:
            src = n.args[0]
            if not isinstance(src, Node):
                break
            if n.op != GETITEM and info(n.op).index is None:
                break
            n = src
        return n

    def roots(self, n: Node) -> list[Node]:
        """The nodes whose data a value is read from: through views, and through the
        inputs of the gathers (cat, constant_pad_nd) a kernel computes where it reads."""
        r = self.root(n)
        if self.kinds.get(r) == Kind.INJECTIVE and reads_through(r):
            return [x for i in r.inputs() for x in self.roots(i)]
        return [r]

    # -- the pass -------------------------------------------------------------------------
    def run(self) -> Partition:
        for n in self.g.nodes:
            k = self.kinds.get(n)
            if k is None or k == Kind.INJECTIVE or (k <= Kind.BROADCAST and is_generator(n)):
                continue  # views and generators are computed where they are read
            self._new_group(n)
            if self.fusable(n):
                self._fuse_producers(n)
        self._retry_vertical()
        self._fuse_siblings()
        self._attach_epilogues()
        self._record_boundaries()
        return self._result()

    def _fuse_producers(self, n: Node) -> None:
        seen: set[int] = set()
        for p in dict.fromkeys(p for i in n.inputs() for p in self.roots(i)):
            gid = self.group_of.get(p)
            if gid is None or gid == self.group_of[n] or gid in seen:
                continue
            seen.add(gid)
            if not self.fusable(p):
                continue
            reason = self._try_merge(gid, self.group_of[n])
            if reason:
                self._reject(p, n, reason)
                self.refused.append((p, n, self.rejected[-1]))
            else:
                self._fused(p.name, n.name, "vertical")

    def _retry_vertical(self) -> None:
        """Merges refused while a consumer was still on its own, tried again once every
        group is formed: a producer read through a cat by amax and by sub (softmax over a
        concatenation) could not join amax while sub, outside, still needed it stored."""
        for p, n, _ in self.refused:
            a, b = self.group_of[p], self.group_of[n]
            if a != b and self.fusable(p) and self._try_merge(a, b) is None:
                self._fused(p.name, n.name, "vertical, retried")
        for p, n, rejection in self.refused:
            if self.group_of[p] == self.group_of[n]:  # fused after all, one way or another
                self.rejected.remove(rejection)

    def _try_merge(self, a: int, b: int) -> str | None:
        reason = can_fuse(self, a, b, self.lowerable)
        if reason:
            return reason
        if not self.fuel.take():
            return "optimization fuel exhausted (OPFUSE_FUEL)"
        self._union(a, b)
        return None

    def _fuse_siblings(self) -> None:
        """Groups over the same domain (pointwise: same shape; reductions: same input shape
        and reduced dims) that read the same tensor become one kernel: it is read once."""
        readers: dict[Node, list[int]] = {}
        for gid, nodes in self.members.items():
            key = self._domain_key(nodes)
            if key is None:
                continue
            numel = math.prod(key[0])
            for r in self._external_roots(nodes):
                # A tensor every element reads (a broadcast scalar) is no reason to merge.
                if r.tensor.numel >= numel:
                    readers.setdefault(r, []).append(gid)
        for gids in readers.values():
            live = [g for g in dict.fromkeys(gids) if g in self.members]
            while len(live) > 1:
                a = live[0]
                for b in live[1:]:
                    if b not in self.members or a not in self.members:
                        continue
                    if self._domain_key(self.members[a]) != self._domain_key(self.members[b]):
                        continue
                    names = (self.members[a][0].name, self.members[b][0].name)
                    if self._try_merge(a, b) is None:
                        self._fused(*names, "siblings")
                live = [g for g in live[1:] if g in self.members]

    def _domain_key(self, nodes: list[Node]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        kinds = [self.kinds.get(n, Kind.OPAQUE) for n in nodes]
        if all(k <= Kind.BROADCAST for k in kinds):
            return _domain(nodes), ()
        if all(k <= Kind.BROADCAST or k == Kind.REDUCTION for k in kinds):
            r = next(n for n, k in zip(nodes, kinds) if k == Kind.REDUCTION)
            return reduction_domain(r)
        return None

    def _attach_epilogues(self) -> None:
        """A matmul or convolution takes the pointwise group that consumes its result as
        its epilogue (how it then runs is measured later)."""
        for a in self.g.nodes:
            if self.kinds.get(a) != Kind.ANCHOR or len(self.members[self.group_of[a]]) != 1:
                continue
            consumers = epilogue_consumers(self, a)
            if not consumers:
                continue
            refused = can_take_epilogue(self, a, consumers, self.lowerable)
            if refused is None and not self.fuel.take():
                refused = consumers[0], "optimization fuel exhausted (OPFUSE_FUEL)"
            if refused is not None:
                self._reject(a, *refused)
                continue
            self._union(self.group_of[a], self.group_of[consumers[0]])
            self._fused(a.name, consumers[0].name, "epilogue")

    def _record_boundaries(self) -> None:
        """Say why a fused value leaves its kernel for a library call or a torch op."""
        seen: set[tuple[Node, Node]] = set()
        for n in self.g.nodes:
            k = self.kinds.get(n)
            if k is None or self.fusable(n) or k == Kind.INJECTIVE:
                continue
            for i in n.inputs():
                p = self.root(i)
                if not self.fusable(p) or (p, n) in seen:
                    continue
                seen.add((p, n))
                what = "reduced value" if self._in_reduction_group(p) else "value"
                if k == Kind.ANCHOR:
                    lib = "a convolution" if "convolution" in n.op else "a matmul"
                    self._reject(p, n, f"{what} feeds {lib} (a library call)")
                else:
                    why = self.why_opaque.get(n, "no fused implementation")
                    self._reject(p, n, f"{what} feeds {n.op}: {why}")

    def _in_reduction_group(self, n: Node) -> bool:
        gid = self.group_of.get(n)
        return gid is not None and any(
            self.kinds.get(m) == Kind.REDUCTION for m in self.members[gid]
        )

    def _external_roots(self, nodes: Iterable[Node]) -> set[Node]:
        inside = set(nodes)
        out = set()
        for n in inside:
            for i in n.inputs():
                r = self.root(i)
                if r not in inside and isinstance(r.meta, TensorMeta):
                    out.add(r)
        return out

    def _result(self) -> Partition:
        groups: list[Group] = []
        for nodes in self.members.values():
            kinds = {self.kinds[n] for n in nodes}
            if Kind.REDUCTION in kinds:
                pattern, anchor, reason = Pattern.REDUCTION, None, ""
            elif kinds <= {Kind.ELEMENTWISE, Kind.BROADCAST}:
                pattern, anchor, reason = Pattern.ELEMENTWISE, None, ""
            elif kinds == {Kind.ANCHOR}:
                pattern, anchor, reason = Pattern.LIBRARY, nodes[0], ""
            elif Kind.ANCHOR in kinds:
                anchor = next(n for n in nodes if self.kinds[n] == Kind.ANCHOR)
                conv = "convolution" in anchor.op
                pattern = Pattern.CONV_EPILOGUE if conv else Pattern.GEMM_EPILOGUE
                reason = ""
            elif nodes[0].op == ATTENTION:  # the fused attention call (rewrite/attention)
                pattern, anchor, reason = Pattern.ATTENTION, nodes[0], ""
            else:
                pattern, anchor = Pattern.FALLBACK, nodes[0]
                reason = self.why_opaque.get(nodes[0], "no fused implementation")
            groups.append(Group(len(groups), nodes, pattern, anchor, reason))
        groups = _toposort(groups, self.g)
        for i, g in enumerate(groups):
            g.id = i
        return Partition(groups, self.rejected, self.fusions)


def _domain(nodes: list[Node]) -> tuple[int, ...]:
    return max((n.tensor.shape for n in nodes), key=len)


def _toposort(groups: list[Group], graph: Graph) -> list[Group]:
    owner = {n: i for i, g in enumerate(groups) for n in g.nodes}
    deps: list[set[int]] = [set() for _ in groups]
    for i, g in enumerate(groups):
        for n in g.nodes:
            for src in n.inputs():
                stack = [src]
                while stack:  # through views (they are not group members)
                    s = stack.pop()
                    j = owner.get(s)
                    if j is not None:
                        if j != i:
                            deps[i].add(j)
                    elif s.op not in (INPUT, CONSTANT):
                        stack.extend(s.inputs())
    order: list[Group] = []
    done: set[int] = set()
    first = {i: min(graph.index[n] for n in g.nodes) for i, g in enumerate(groups)}
    pending = sorted(range(len(groups)), key=first.__getitem__)
    while pending:
        for i in pending:
            if deps[i] <= done:
                order.append(groups[i])
                done.add(i)
                pending.remove(i)
                break
        else:
            raise AssertionError("cycle between fusion groups")
    return order


def partition(
    graph: Graph, classified: Classified, lowerable: Lowerable, fuel: Fuel | None = None
) -> Partition:
    """Group the graph's nodes; see the module docstring. `lowerable` answers what only the
    lowering knows (lower/lowering.why_not_lowered)."""
    return _Partitioner(graph, classified, fuel or Fuel(), lowerable).run()
