"""Training throughput: one optimizer step (forward, backward, SGD) under eager,
torch.compile (inductor) and torch.compile(backend="opfuse"), samples per second."""

from __future__ import annotations

import copy
from collections.abc import Callable
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


CASES = (("bert_base", 8), ("resnet50", 8))
