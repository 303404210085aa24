"""A graph with symbolic sizes compiled at one size, serving others without a compile.

The compile of a graph with symbolic sizes records every decision it takes from their
values (ir/size.Decisions: each comparison of a Size, each value given up as a plain
number). At another size where every one of them comes out the same, capture, fusion,
lowering, rendering, tuning and planning would decide alike, and the library it built
computes that size too (its kernels take the sizes as arguments). What differs is the
values of the Sizes alone: `serve` evaluates them in the compiled plan (layouts of
buffers, the views' arguments, the size symbols the kernels read, pool blocks) and
returns a CompiledGraph that runs the same library.

A compile serves other sizes only where every value its plan holds follows the symbols
(`why_not`): each kernel printed every Size as its expression (Module.generic), every step
is a kernel of the C library or an aten op (a library call set up at compile time keeps
its sizes inside), and no constant holds a value computed at this size.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..ir.graph import CONSTANT, TensorMeta
from ..ir.size import PREFIX, Size, value_at
from ..settings import flag
from .execute import Const, In, KernelStep, Out, Plan, Runtime, Scratch, TorchStep
from .plan import DIRECT, storage_bytes

if TYPE_CHECKING:
    from ..pipeline import CompiledGraph

_OpOverload = torch._ops.OpOverload


def why_not(compiled: CompiledGraph) -> str | None:
    """Why `compiled` cannot serve other sizes of its graph; None: it can, where its
    decisions hold."""
    if compiled.decisions is None or compiled.template is None:
        return "its sizes are static"
    if not compiled.generic:
        return "a kernel holds a size as its value"
    for n in compiled.graph.nodes:
        if n.op == CONSTANT and isinstance(n.meta, TensorMeta) and n.meta.symbolic:
            return f"constant {n.name} was computed at this size"
    for step in compiled.template.steps:
        if isinstance(step, KernelStep):
            if step.tensors:
                return f"{step.name} is a Triton kernel"
            continue
        if step.at is None:
            if not _of_arguments(step.fn) or step.inplace is not None:
                return f"{step.name} is a library call set up at this size"
            if step.guard is not None:
                return f"{step.name} is a guarded library call"
        if step.out_fn is not None and not isinstance(step.out_fn, _OpOverload):
            return f"{step.name} writes through a library call set up at this size"
    return None


def _of_arguments(fn: Any) -> bool:
    """A torch step's function computes from its arguments alone (a torch op, or the body
    of one of opfuse's ops), not from sizes a library call was set up at."""
    return isinstance(fn, _OpOverload) or any(fn is f for f in DIRECT.values())


def note(compiled: CompiledGraph) -> str | None:
    """For the report: what the compile decided from the sizes, and whether it serves
    others (None: its sizes are static)."""
    if compiled.decisions is None:
        return None
    why = why_not(compiled)
    serves = "other sizes where they come out the same" if why is None else f"no other: {why}"
    return f"{len(compiled.decisions)} decisions taken from the sizes' values; serves {serves}"


def unserved(compiled: CompiledGraph, values: Mapping[str, int]) -> str:
    """For the report of the compile made instead: why `compiled` does not serve the size
    symbols' `values` (serve returned None)."""
    at = f"the compile at {_shown(compiled.values)}"
    why = _refusal(compiled, values)
    if why is not None or compiled.decisions is None:
        return f"{at} {why}"
    otherwise = compiled.decisions.otherwise({k: values[k] for k in compiled.values})
    count = f" ({len(otherwise)} in all)" if len(otherwise) > 2 else ""
    return f"{at} would decide otherwise here: {', '.join(otherwise[:2]) or '?'}{count}"


def _refusal(compiled: CompiledGraph, values: Mapping[str, int]) -> str | None:
    """Why `compiled` serves no size but its own, or not `values`' symbols; None: it
    serves them where its decisions hold (serve and unserved ask it first)."""
    why = why_not(compiled)
    if why is not None:
        return f"serves no other size: {why}"
    if not set(compiled.values) <= set(values):
        return "has other size symbols"
    return None


def _shown(values: Mapping[str, int]) -> str:
    """Symbol values as the report shows them: `s0=16, s1=3`."""
    return ", ".join(f"{k.removeprefix(PREFIX)}={v}" for k, v in sorted(values.items()))


def serve(compiled: CompiledGraph, values: Mapping[str, int]) -> CompiledGraph | None:
    """`compiled` at the size symbols' `values` (by C name), or None where one of its
    decisions would come out otherwise there (or it serves no other size: why_not)."""
    decisions, template = compiled.decisions, compiled.template
    if decisions is None or template is None or _refusal(compiled, values) is not None:
        return None
    values = {k: values[k] for k in compiled.values}
    if not decisions.hold(values):
        return None
    report = copy.copy(compiled.report)
    report.dynamic = [
        *report.dynamic,
        f"served by the compile at {_shown(compiled.values)}: its {len(decisions)} decisions "
        "on the sizes come out the same here (runtime/sized.py)",
    ]
    report.compile_seconds = 0.0
    return dataclasses.replace(
        compiled,
        run=Runtime(plan_at(template, values)),
        report=report,
        values=dict(values),
    )


def plan_at(plan: Plan, values: Mapping[str, int]) -> Plan:
    """`plan` with every Size evaluated at `values`, as plain ints (a plan with symbolic
    sizes runs as this: the runtime's layout checks compare plain ints)."""
    steps: list[Any] = []
    for s in plan.steps:
        if isinstance(s, KernelStep):
            steps.append(dataclasses.replace(s, args=[_arg(a, values) for a in s.args]))
        else:
            if s.at is not None:  # a library call set up for these sizes
                call = s.at(values)
                s = dataclasses.replace(s, fn=call.call, inplace=call.inplace, guard=call.guard)
            steps.append(
                dataclasses.replace(
                    s,
                    args=_value(s.args, values),
                    kwargs={k: _value(v, values) for k, v in s.kwargs.items()},
                    donor=s.donor.at(values) if s.donor is not None else None,
                    out_meta=s.out_meta.at(values) if s.out_meta is not None else None,
                )
            )
    return dataclasses.replace(
        plan,
        outputs=[_value(o, values) for o in plan.outputs],
        steps=steps,
        pool_sizes=pool_sizes(plan, values),
        notes=dict(plan.notes),
    )


def pool_sizes(plan: Plan, values: Mapping[str, int]) -> list[int]:
    """Each pooled block as large as the largest buffer the plan puts in it at `values`
    (which block a buffer takes weighs sizes alone: runtime/plan._plan_memory)."""
    out = [0] * len(plan.pool_sizes)
    for s in plan.steps:
        if isinstance(s, TorchStep):
            if s.out_block is not None and s.out_meta is not None:
                nbytes = storage_bytes(s.out_meta.at(values))
                out[s.out_block] = max(out[s.out_block], nbytes)
            continue
        for a in s.args:
            if isinstance(a, Scratch) and a.block is not None:
                out[a.block] = max(out[a.block], value_at(a.nbytes, values))
            elif isinstance(a, Out) and a.block is not None:
                out[a.block] = max(out[a.block], storage_bytes(a.meta.at(values)))
    return out


def describe(plan: Plan) -> list[Any]:
    """What a plan does, as plain values: two plans with equal descriptions run the same
    steps on the same layouts (the check that a served size is what a compile at it
    would have made: OPFUSE_CHECK_SERVED)."""

    def arg(a: Any) -> Any:
        if isinstance(a, (In, Out)):
            pooled = getattr(a, "block", None) is not None
            return (type(a).__name__, a.slot, _layout(a.meta), pooled)
        if isinstance(a, Const):
            v = a.value
            return ("tensor", tuple(v.shape)) if isinstance(v, torch.Tensor) else ("int", v)
        if isinstance(a, Scratch):
            return ("scratch", int(a.nbytes))
        return (type(a).__name__, getattr(a, "slot", None))

    # (not which pooled block each buffer takes: any is correct, runtime/plan._plan_memory)
    out: list[Any] = [plan.n_slots, list(plan.input_slots), repr(plan.outputs)]
    for s in plan.steps:
        if isinstance(s, KernelStep):
            out.append((s.name, [arg(a) for a in s.args], list(s.inplace)))
        else:
            meta = _layout(s.out_meta) if s.out_meta is not None else None
            # (a library call by its setup's name: its closures differ per setup)
            fn = getattr(s.fn, "__qualname__", None) if s.at is not None else str(s.fn)
            out.append(
                (
                    s.name,
                    fn,
                    s.guard is not None,
                    repr(s.args),
                    repr(s.kwargs),
                    s.output,
                    s.view,
                    meta,
                )
            )
    return out


def _layout(m: TensorMeta) -> tuple[Any, ...]:
    return (tuple(map(int, m.shape)), tuple(map(int, m.stride)), int(m.offset), m.dtype)


def _arg(a: Any, values: Mapping[str, int]) -> Any:
    if isinstance(a, (In, Out)):
        return dataclasses.replace(a, meta=a.meta.at(values))
    if isinstance(a, Const) and isinstance(a.value, Size):
        return Const(value_at(a.value, values))
    if isinstance(a, Scratch):
        return dataclasses.replace(a, nbytes=value_at(a.nbytes, values))
    return a  # a constant tensor or address, a weight packed from an input (execute.Packed)


def _value(v: Any, values: Mapping[str, int]) -> Any:
    if isinstance(v, Size):
        return value_at(v, values)
    if type(v) in (list, tuple):
        return type(v)(_value(x, values) for x in v)
    return v


def check(served: CompiledGraph, compile_here: Callable[[], CompiledGraph]) -> None:
    """Under OPFUSE_CHECK_SERVED: compile the served size as well (`compile_here`) and raise
    where the two differ."""
    if not flag("OPFUSE_CHECK_SERVED"):
        return
    problem = differences(served, compile_here())
    if problem is not None:
        raise AssertionError(f"opfuse: a served size differs from its compile: {problem}")


def differences(served: CompiledGraph, fresh: CompiledGraph) -> str | None:
    """How a served size differs from a compile at it (None: not at all)."""
    if served.kernels != fresh.kernels:
        return "the kernels' source"
    a, b = describe(served.run.plan), describe(fresh.run.plan)
    if len(a) != len(b):
        return f"{len(a)} against {len(b)} entries of the plan"
    for x, y in zip(a, b):
        if x != y:
            return f"plan entry {x!r} against {y!r}"
    return None
