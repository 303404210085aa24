"""Gradients through a graph compiled for inference (opfuse.compile's CompiledModule).

The graph runs without autograd. Where eager's outputs would require grad, because they
depend on a parameter that does (an eval-mode model fine-tuned, BatchNorm frozen), those
outputs get a backward that runs eager's forward at the same inputs again and
differentiates it: only a backward pays for the second forward.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir.graph import CONSTANT
from . import structure
from .capture import Captured

_REQUIRES_GRAD = operator.attrgetter("requires_grad")

THROUGH = object()  # with_grad's answer where the call must run through torch.compile


@dataclass
class GradOutputs:
    """Per compiled module: which outputs of each capture depend on a parameter that
    requires grad, and the captures whose outputs share memory (through torch.compile)."""

    found: dict[tuple[int, tuple[bool, ...]], tuple[Captured, list[bool] | None]] = field(
        default_factory=dict
    )
    shared: set[int] = field(default_factory=set)  # id() of those captures

    def needs(
        self, cap: Captured, model: torch.nn.Module, params: Sequence[torch.Tensor]
    ) -> list[bool] | None:
        """Per user output of `cap`: does it depend on a parameter that requires grad now
        (a constant of its graph shares the storage of the tensor it froze under that
        parameter's name)? None where none does. Found once per capture and set of such
        parameters."""
        flags = tuple(map(_REQUIRES_GRAD, params))
        if not any(flags):
            return None
        hit = self.found.get((id(cap), flags))
        if hit is not None and hit[0] is cap:
            return hit[1]
        # by name: a deep copy's graphs hold the original's tensors until either changes
        wanted = {n for n, p in model.named_parameters() if p.requires_grad}
        ptrs = {t.data_ptr() for n, t in cap.frozen.items() if n in wanted}
        g = cap.graph
        depends: dict[Any, bool] = {}
        for n in g.nodes:  # in order: inputs before their users
            if n.op == CONSTANT:
                t = g.constants.get(n.name)
                depends[n] = t is not None and t.data_ptr() in ptrs
            else:
                depends[n] = any(depends.get(i, False) for i in n.inputs())
        user = [
            depends.get(o, False)
            for o, (role, _) in zip(g.outputs, cap.output_roles)
            if role == "user"
        ]
        result = user if any(user) else None
        if len(self.found) > 64:
            self.found.clear()
        self.found[(id(cap), flags)] = (cap, result)
        return result


def with_grad(
    grads: GradOutputs,
    out: Any,
    cap: Captured,
    model: torch.nn.Module,
    params: Sequence[torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """`out`, the graph's outputs for `model(*args, **kwargs)`, with those that eager's
    would have requiring grad as outputs of a node whose backward differentiates eager's
    forward, run again; THROUGH where the call must run through torch.compile instead."""
    needs = grads.needs(cap, model, params)
    if needs is None or any(role != "user" for role, _ in cap.output_roles):
        # (a graph that writes its inputs or buffers: running the model again, for a
        # backward or through torch.compile, would write them twice)
        return out
    flat, spec = structure.flatten(out)
    if len(flat) != len(needs):
        return THROUGH
    picked = [k for k, t in enumerate(flat) if needs[k] and t.dtype.is_floating_point]
    # one tensor returned in several places (hidden_states[-1] is last_hidden_state)
    # is one output of the node, as it is one tensor in eager's
    first: dict[int, int] = {}
    for k in picked:
        first.setdefault(id(flat[k]), k)
    unique = list(first.values())
    storages = {flat[k].untyped_storage().data_ptr() for k in unique}
    if len(storages) < len(unique):
        # outputs that share memory: eager's writes through one show in the other,
        # and autograd tracks them as views of one another; torch.compile keeps that
        grads.shared.add(id(cap))
        return THROUGH
    outs = []
    for k in unique:
        t = flat[k]
        if t._is_view():  # autograd forbids writing in place to a custom node's views
            t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            t.copy_(flat[k])
        outs.append(t)

    def recompute() -> list[torch.Tensor]:
        again, _ = structure.flatten(model(*args, **kwargs))
        if len(again) != len(flat):
            raise RuntimeError("opfuse: the model's outputs changed structure since")
        return [again[k] for k in unique]

    wanted = list(filter(_REQUIRES_GRAD, params))
    outputs = _Recomputed.apply(_Again(recompute, wanted, outs), *wanted)
    by_id = {id(flat[k]): g for k, g in zip(unique, outputs)}
    for k in picked:
        flat[k] = by_id[id(flat[k])]
    return structure.unflatten(spec, flat)


@dataclass
class _Again:
    recompute: Callable[[], list[torch.Tensor]]  # eager's differentiable outputs, again
    params: list[torch.Tensor]
    outs: list[torch.Tensor]  # the graph's: fresh tensors each call, returned as they are


class _Recomputed(torch.autograd.Function):
    """The graph's outputs (computed without autograd) as outputs of a node whose backward
    differentiates eager's forward, run again."""

    @staticmethod
    def forward(ctx: Any, again: _Again, *params: torch.Tensor) -> Any:
        ctx.again = again
        outs, again.outs = again.outs, []  # (not kept alive by the graph)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        again: _Again = ctx.again
        with torch.enable_grad():
            outs = again.recompute()
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        got = torch.autograd.grad(
            [o for o, _ in pairs],
            again.params,
            [g for _, g in pairs],
            allow_unused=True,
            create_graph=torch.is_grad_enabled(),
        )
        return (None, *got)
