"""Decompose an exported graph op by op (capture's step after torch.export).

Retracing the whole graph with make_fx costs a dispatch through fake tensors for every op,
also for the many ops no decomposition touches (BERT-base: 0.7-1.2 s of a 3.3 s compile).
Here only the ops a decomposition applies to are traced, and an op seen before with the
same argument layouts reuses its trace, so a model's repeated blocks trace once; all of
them in one make_fx call, cut apart afterwards and spliced into a copy of the graph
(BERT-base: 17 distinct ops of 466, 0.15 s; ResNet-50: 55, 0.2 s)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

# The node metadata capture reads (shapes come from the traced nodes' own "val").
_KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


@dataclass
class _Op:
    """One distinct op (target and argument layouts) to decompose, and its trace."""

    target: Any
    flat: list[Any]  # its arguments, flattened; fx nodes where tensors go
    spec: Any
    at: list[int]  # positions of the tensors in flat
    inputs: list[torch.fx.Node] = field(default_factory=list)  # its placeholders
    nodes: list[torch.fx.Node] = field(default_factory=list)  # its decomposition
    out: Any = None  # its result: nodes of `nodes` or `inputs`


def retrace(
    gm: torch.fx.GraphModule,
    table: Mapping[Any, Callable[..., Any]],
    context: Callable[[], Any],
) -> torch.fx.GraphModule | None:
    """`gm` with every op that `table` or a composite kernel decomposes replaced by its
    decomposition, traced with make_fx under `context()`. None when a decomposition needs
    what a splice cannot carry (a constant attribute, a submodule)."""
    ops: dict[Any, _Op] = {}
    calls: dict[torch.fx.Node, tuple[_Op, list[Any]]] = {}  # node -> its op, its arguments
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if not _decomposes(n.target, table):
            continue
        flat, spec = pytree.tree_flatten((n.args, n.kwargs))
        at = [i for i, a in enumerate(flat) if isinstance(a, torch.fx.Node)]
        if not all(isinstance(flat[i].meta.get("val"), torch.Tensor) for i in at):
            return None
        key = (n.target, tuple(_key(a) for a in flat))
        calls[n] = (ops.setdefault(key, _Op(n.target, flat, spec, at)), flat)
    if ops and not _trace(list(ops.values()), table, context):
        return None

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            src = env[n.args[0]]
            if isinstance(src, (tuple, list)):  # an element of a decomposed op's result
                env[n] = src[n.args[1]]
                continue
        if n not in calls:
            env[n] = graph.node_copy(n, lambda x: env[x])
            continue
        op, flat = calls[n]
        env[n] = _splice(graph, op, [env[flat[i]] for i in op.at], n.meta)
    return torch.fx.GraphModule(gm, graph)


def _trace(ops: list[_Op], table: Mapping[Any, Any], context: Callable[[], Any]) -> bool:
    """Trace every op's decomposition in one make_fx call (a trace's setup costs more than
    most decompositions: ResNet-50 has 55 distinct ones) and cut the graph into each op's
    part: after each op the function adds 1 to a marker input, and those adds are the cuts.
    False when a decomposition left what a splice cannot carry."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = [_empty_like(op.flat[i].meta["val"]) for op in ops for i in op.at]
        fakes.append(torch.zeros(()))

    def run(*tensors: torch.Tensor) -> Any:
        marker, k, outs = tensors[-1], 0, []
        for op in ops:
            vals = list(op.flat)
            for i in op.at:
                vals[i], k = tensors[k], k + 1
            args, kwargs = pytree.tree_unflatten(vals, op.spec)
            outs.append((op.target(*args, **kwargs), marker + 1))
        return outs

    with context():
        traced = make_fx(run, decomposition_table=table, tracing_mode="fake")(*fakes)
    placeholders = list(traced.graph.find_nodes(op="placeholder"))
    marker = placeholders[-1]
    k = 0
    for op in ops:
        op.inputs, k = placeholders[k : k + len(op.at)], k + len(op.at)
    i = 0
    for x in traced.graph.nodes:
        if x.op in ("get_attr", "call_module"):
            return False
        if x.op == "call_function" and marker in x.args:
            i += 1  # the cut after op i
        elif x.op == "call_function":
            ops[i].nodes.append(x)
        elif x.op == "output":
            for op, (out, _) in zip(ops, x.args[0], strict=True):
                op.out = out
    return True


def _decomposes(target: Any, table: Mapping[Any, Any]) -> bool:
    """Would make_fx (with `table`) trace `target` into other ops? Ops with Python kernels
    are retraced too: the Python dispatcher may route them elsewhere (eval BatchNorm)."""
    if not isinstance(target, torch._ops.OpOverload):
        return True  # a Python callable: traced to find out
    return (
        target in table
        or bool(target.py_kernels)
        or torch._C._dispatch_has_kernel_for_dispatch_key(
            target.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        )
    )


def _key(a: Any) -> tuple[Any, ...]:
    """An argument as the trace depends on it: a tensor's layout, any other value itself."""
    if isinstance(a, torch.fx.Node):
        t = a.meta["val"]
        return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, str(t.device))
    return (type(a).__name__, repr(a))


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor (fake, under a FakeTensorMode) with t's exact layout, sizes plain."""
    shape = tuple(int(s) for s in t.shape)
    stride = tuple(int(s) for s in t.stride())
    offset = int(t.storage_offset())
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    span = 0 if 0 in shape else 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride))
    base = torch.empty(offset + span, dtype=t.dtype, device=t.device)
    return base.as_strided(shape, stride, offset)


def _splice(graph: torch.fx.Graph, op: _Op, inputs: list[Any], meta: dict[str, Any]) -> Any:
    """Copy op's decomposition into `graph`, its placeholders bound to `inputs`; returns
    the values of its result (a node, or a tuple of them). The copies carry the decomposed
    op's module path and source line."""
    bound: dict[torch.fx.Node, Any] = dict(zip(op.inputs, inputs, strict=True))
    for x in op.nodes:
        y = graph.node_copy(x, lambda z: bound[z])
        for k in _KEPT_META:
            if k in meta:
                y.meta[k] = meta[k]
        bound[x] = y
    return pytree.tree_map(lambda y: bound[y] if isinstance(y, torch.fx.Node) else y, op.out)
