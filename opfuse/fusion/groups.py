"""What the fusion decision produces: groups of nodes, each to run as one kernel or call."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.graph import Graph, Node
from ..ir.strenum import StrEnum


class Pattern(StrEnum):
    """What a group is, and so how it runs."""

    ELEMENTWISE = "elementwise"  # pointwise ops: one generated kernel
    REDUCTION = "reduction"  # reductions with the pointwise ops around them: one kernel
    GEMM_EPILOGUE = "gemm_epilogue"  # a matmul and the pointwise ops on its result
    CONV_EPILOGUE = "conv_epilogue"  # a convolution and the pointwise ops on its result
    LIBRARY = "library"  # a matmul or convolution alone
    ATTENTION = "attention"  # the fused attention call (rewrite/attention.py)
    FALLBACK = "fallback"  # torch runs it

    @property
    def generated(self) -> bool:
        """Is the group one kernel opfuse generates?"""
        return self in (Pattern.ELEMENTWISE, Pattern.REDUCTION)

    @property
    def epilogue(self) -> bool:
        return self in (Pattern.GEMM_EPILOGUE, Pattern.CONV_EPILOGUE)


@dataclass
class Group:
    id: int
    nodes: list[Node]  # topological order; views are never members
    pattern: Pattern
    anchor: Node | None = None  # the matmul/conv of an epilogue group, or the library call
    reason: str = ""  # why a fallback group runs with torch

    @property
    def ops(self) -> list[str]:
        return [n.op for n in self.nodes]


@dataclass(frozen=True)
class Rejection:
    """Two ops that could have fused but did not, and why (WhyNoFuse)."""

    producer: str
    consumer: str
    reason: str

    def __str__(self) -> str:
        return f"{self.producer} -> {self.consumer}: {self.reason}"


@dataclass
class Partition:
    groups: list[Group]  # in an order that respects every dependency
    rejected: list[Rejection] = field(default_factory=list)
    fusions: list[tuple[str, str]] = field(default_factory=list)  # merges, in order

    def group_of(self) -> dict[Node, Group]:
        return {n: g for g in self.groups for n in g.nodes}


def check_partition(graph: Graph, part: Partition) -> None:
    """A sanity check (hidet style): every compute node that is not a view is in exactly
    one group, and groups are listed after the groups they read from."""
    from ..ir.graph import CONSTANT, GETITEM, INPUT
    from ..ir.ops import Kind, info, is_generator

    owner: dict[Node, int] = {}
    for i, g in enumerate(part.groups):
        for n in g.nodes:
            assert n not in owner, f"{n.name} is in two groups"
            owner[n] = i
    for n in graph.nodes:
        if n.op in (INPUT, CONSTANT) or n.op == GETITEM:
            continue
        if n not in owner and (info(n.op).kind == Kind.INJECTIVE or is_generator(n)):
            continue
        assert n in owner, f"{n.name} is in no group"
    for i, g in enumerate(part.groups):
        for n in g.nodes:
            for src in n.inputs():
                j = owner.get(_through_views(src, owner))
                assert j is None or j <= i, f"group {i} reads {src.name} from later group {j}"


def _through_views(n: Node, owner: dict[Node, int]) -> Node:
    from ..ir.ops import Kind, info

    while (
        n not in owner
        and n.args
        and isinstance(n.args[0], Node)
        and (info(n.op).kind == Kind.INJECTIVE)
    ):
        n = n.args[0]
    return n
