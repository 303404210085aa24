"""Training throughput: one optimizer step (forward, backward, SGD) under eager,
torch.compile (inductor) and torch.compile(backend="opfuse"), samples per second."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import models


def setup(
    name: str, batch: int
) -> tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]:
    model, inputs = models.build(name, batch)
    model.train()
    if name == "resnet50":
        target = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(1))
        return model, inputs, lambda out: F.cross_entropy(out, target)
    return model, inputs, lambda out: out.float().pow(2).mean()


def step_fn(
    model: nn.Module, inputs: tuple[Any, ...], loss_fn: Callable[[Any], torch.Tensor], how: str
) -> tuple[Callable[[], float], nn.Module]:
    """A closure running one optimizer step on a private copy of `model`."""
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9)
    if how == "eager":
        fwd: Any = m
    elif how == "inductor":
        fwd = torch.compile(m)
    else:
        fwd = torch.compile(m, backend="opfuse")

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(fwd(*inputs))
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, m


# The library calls no fusion compiler makes faster: GEMMs and convolutions, forward and
# backward (each the innermost op torch's profiler sees, so self times do not overlap).
LIBRARY_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::mkldnn_convolution",
        "aten::convolution_backward",
        "aten::mkldnn_convolution_backward",
    }
)


def library_seconds(step: Callable[[], float]) -> float:
    """Seconds of one step spent in library calls and in the optimizer's update, by torch's
    profiler. Both are long calls, so the profiler's per-op overhead (which inflates the
    thousands of small ops around them) barely touches them. With the unprofiled step time
    they bound what fusing the rest can give (Amdahl): step / (library + optimizer)."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    library = sum(e.self_cpu_time_total for e in events if e.key in LIBRARY_OPS)
    optimizer = sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step#"))
    return (library + optimizer) / 1e6


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints two lines to the process's stderr per profiled region; the bench's
    table is easier to read without forty of them. Python errors still raise."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


CASES = (("bert_base", 8), ("resnet50", 8))
