"""Double backward through a graph compiled by `torch.compile(backend="opfuse")`.

AOTAutograd's compiled backward cannot be differentiated again: a gradient penalty (WGAN-GP,
R1), a physics-informed loss on input derivatives or MAML's second-order step computes
`torch.autograd.grad(..., create_graph=True)` and then differentiates the result, and the
second backward raises "torch.compile with aot_autograd does not currently support double
backward" (under inductor too). Eager runs those models, so opfuse must.

The compiled callable runs inside an autograd Function of ours. A plain backward goes
through the compiled backward as before. A backward with `create_graph=True` replays the
captured graph eagerly on the saved inputs and differentiates the replay, which records the
graph the next backward needs. Replaying must reproduce the forward exactly, so graphs that
update state (BatchNorm running statistics, in-place writes to inputs), return an alias of
an input, or draw random numbers (opfuse draws them inside kernels, with its own
generator) are left as AOTAutograd made them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Facts:
    """What the forward compiler learnt about the graph (filled while AOTAutograd
    compiles it): can the graph be replayed eagerly with the same result?"""

    replayable: bool = False


def learn(facts: Facts, forward: torch.fx.GraphModule) -> None:
    """Record, from AOTAutograd's metadata and the forward graph, whether replaying it is
    exact (called by the forward compiler)."""
    facts.replayable = False
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None:
        return
    from torch._functorch._aot_autograd.schemas import OutputType

    mutates = any(i.mutates_data or i.mutates_metadata for i in meta.input_info)
    aliases = any(o.output_type is not OutputType.non_alias for o in meta.output_info)
    random = any(
        torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
        for n in forward.graph.nodes
        if n.op == "call_function"
    )
    facts.replayable = not (mutates or aliases or random)


def twice_differentiable(
    compiled: Callable[..., Any], gm: torch.fx.GraphModule, facts: Facts
) -> Callable[..., Any]:
    """`compiled`, whose gradients can be differentiated again where replaying `gm` is
    exact; `compiled` itself elsewhere."""
    if not facts.replayable:
        return compiled

    def run(*args: Any) -> Any:
        if not torch.is_grad_enabled() or not any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            return compiled(*args)
        return _Replayable.apply(compiled, gm, *args)

    return run


class _Replayable(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, compiled: Any, gm: Any, *args: Any) -> Any:
        # The compiled graph runs on detached copies of the inputs, recording its own
        # autograd graph (AOTAutograd's compiled backward) for the plain backward.
        inner = [
            a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a
            for a in args
        ]
        with torch.enable_grad():
            outs = compiled(*inner)
        single = not isinstance(outs, (tuple, list))
        outs_list: Sequence[Any] = (outs,) if single else outs
        ctx.gm, ctx.inner, ctx.outs, ctx.single = gm, inner, list(outs_list), single
        ctx.tensor_at = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = {k: a for k, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        ctx.save_for_backward(*(args[k] for k in ctx.tensor_at))
        result = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs_list]
        constant = [
            r
            for r, o in zip(result, outs_list)
            if isinstance(o, torch.Tensor) and not o.requires_grad
        ]
        if constant:
            ctx.mark_non_differentiable(*constant)
        return result[0] if single else tuple(result)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        n_args = len(ctx.tensor_at) + len(ctx.others)
        if torch.is_grad_enabled():  # create_graph=True: differentiate an eager replay
            saved = dict(zip(ctx.tensor_at, ctx.saved_tensors, strict=True))
            args = [saved[k] if k in saved else ctx.others[k] for k in range(n_args)]
            with torch.enable_grad():
                outs = ctx.gm(*args)
            outs = [outs] if ctx.single else list(outs)
            wrt = args
            create = True
        else:
            if ctx.outs is None:
                raise RuntimeError(
                    "Trying to backward through the graph a second time: specify "
                    "retain_graph=True the first time"
                )
            outs, wrt, create = ctx.outs, ctx.inner, False
        pairs = [
            (o, g)
            for o, g in zip(outs, grads)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        need = [k for k, a in enumerate(wrt) if isinstance(a, torch.Tensor) and a.requires_grad]
        got: Sequence[Any] = [None] * len(need)
        if pairs and need:
            keep = torch._C._autograd._get_current_graph_task_keep_graph()
            got = torch.autograd.grad(
                [o for o, _ in pairs],
                [wrt[k] for k in need],
                [g for _, g in pairs],
                retain_graph=keep or create,
                create_graph=create,
                allow_unused=True,
            )
        if not torch._C._autograd._get_current_graph_task_keep_graph():
            ctx.outs = ctx.inner = None  # the compiled graph's saved tensors go now
        per_arg: list[Any] = [None] * n_args
        for k, g in zip(need, got, strict=True):
            per_arg[k] = g
        return (None, None, *per_arg)
