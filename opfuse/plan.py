"""Fusion groups + built kernels -> the runtime Plan: steps in order, value slots, and the
memory pool for intermediates (see runtime.py for how it runs)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .fusion.groups import Partition
from .ir.graph import CONSTANT, GETITEM, INPUT, Graph, Node, TensorMeta, map_args
from .lower.kernel import Kernel
from .runtime import KernelStep, Plan, Slot, TorchStep, assign_pool


@dataclass
class BuiltKernel:
    kernel: Kernel
    fn: Any  # ctypes function


def _aliases_input(n: Node) -> bool:
    """Does this torch op return a view of one of its inputs?"""
    if n.op == GETITEM:
        return True
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return True  # unknown callable: assume it may alias
    return any(r.alias_info is not None for r in schema.returns)


def build_plan(
    graph: Graph,
    part: Partition,
    built: Mapping[int, BuiltKernel],
    library_fn: Callable[[Node], Callable[..., Any] | None] | None = None,
) -> Plan:
    """`built` maps group id -> its compiled kernel; groups without one run with torch.
    `library_fn(node)` may replace the torch callable of an anchor (prepacked weights)."""
    slot = {n: i for i, n in enumerate(graph.nodes)}
    by_name = {n.name: n for n in graph.nodes}
    constants = {slot[n]: graph.constants[n.name] for n in graph.nodes if n.op == CONSTANT}
    steps: list[KernelStep | TorchStep] = []
    ready: set[Node] = {n for n in graph.nodes if n.op in (INPUT, CONSTANT)}
    torch_made: set[Node] = set()
    produced_at: dict[Node, int] = {}
    readers: dict[Node, list[int]] = {}

    def torch_step(n: Node, fn: Callable[..., Any] | None = None) -> None:
        for i in n.inputs():
            need(i)
        target = fn or (operator.getitem if n.op == GETITEM else n.target)
        steps.append(
            TorchStep(
                n.name,
                target,
                map_args(n.args, lambda a: Slot(slot[a])),
                {k: map_args(v, lambda a: Slot(slot[a])) for k, v in n.kwargs},
                slot[n],
            )
        )
        for i in n.inputs():
            readers.setdefault(i, []).append(len(steps) - 1)
        produced_at[n] = len(steps) - 1
        ready.add(n)
        torch_made.add(n)

    def need(n: Node) -> None:
        """Make sure value n exists before the next step (views run lazily, with torch)."""
        if n in ready:
            return
        torch_step(n)

    pooled_outputs: list[tuple[int, int, Node]] = []  # (step, output position, value)
    for g in part.groups:
        bk = built.get(g.id)
        if bk is None:
            for n in g.nodes:
                fn = library_fn(n) if library_fn is not None and n is g.anchor else None
                torch_step(n, fn)
            continue
        k = bk.kernel
        ins = [by_name[b.value] for b in k.inputs]
        outs = [by_name[b.value] for b in k.outputs]
        for i in ins:
            need(i)
        steps.append(
            KernelStep(
                k.name,
                bk.fn,
                [slot[i] for i in ins],
                [i.tensor for i in ins],
                [i in torch_made for i in ins],
                [slot[o] for o in outs],
                [o.tensor for o in outs],
                [None] * len(outs),
            )
        )
        si = len(steps) - 1
        for i in ins:
            readers.setdefault(i, []).append(si)
        for oi, o in enumerate(outs):
            produced_at[o] = si
            ready.add(o)
            pooled_outputs.append((si, oi, o))
    for out in graph.outputs:
        if isinstance(out, Node):
            need(out)

    # Memory plan: an intermediate's lifetime runs to the last read of it or any alias.
    alias_of: dict[Node, Node] = {}
    for s in steps:
        if isinstance(s, TorchStep):
            n = graph.nodes[s.output]
            if _aliases_input(n) and n.inputs():
                base = n.inputs()[0]
                alias_of[n] = alias_of.get(base, base)
    escapes = {alias_of.get(o, o) for o in graph.output_set}
    last_read: dict[Node, int] = {}
    for n, rs in readers.items():
        base = alias_of.get(n, n)
        last_read[base] = max(last_read.get(base, -1), *rs)
    candidates: list[tuple[int, int, Node]] = []
    lifetimes: list[tuple[int, int, int]] = []
    for si, oi, o in pooled_outputs:
        if o in escapes or not isinstance(o.meta, TensorMeta):
            continue
        candidates.append((si, oi, o))
        lifetimes.append((si, last_read.get(o, si), _storage_bytes(o.tensor)))
    blocks, sizes = assign_pool(lifetimes)
    for (si, oi, _), b in zip(candidates, blocks):
        step = steps[si]
        assert isinstance(step, KernelStep)
        step.pooled[oi] = b
    return Plan(
        n_slots=len(graph.nodes),
        input_slots=[slot[i] for i in graph.inputs],
        outputs=[Slot(slot[o]) if isinstance(o, Node) else o for o in graph.outputs],
        constants=constants,
        steps=steps,
        pool_sizes=sizes,
    )


def _storage_bytes(m: TensorMeta) -> int:
    """Bytes spanned by a strided tensor (its largest offset + 1 element)."""
    if m.numel == 0:
        return 0
    span = 1 + sum((s - 1) * st for s, st in zip(m.shape, m.stride))
    return span * m.dtype.itemsize
