"""Benchmark cases: micro patterns (one per fusion pattern) and whole models.

A case builds an eval-mode module and its inputs; micro cases also say how many bytes the
fused op must move at least (inputs read once, outputs written once), which gives its
effective bandwidth."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn


@dataclass
class Case:
    name: str
    group: str  # elementwise | reduction | gemm | conv | model | training
    build: Callable[[], tuple[nn.Module, tuple[Any, ...]]]
    quick: bool = False  # part of `opfuse bench --quick`
    min_bytes: Callable[[tuple[Any, ...], Any], int] | None = None
    notes: dict[str, str] = field(default_factory=dict)


def io_bytes(inputs: tuple[Any, ...], output: Any) -> int:
    """Bytes of distinct input storages read plus output bytes written."""
    seen: set[int] = set()
    total = 0
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * t.element_size()
    outs = output if isinstance(output, (tuple, list)) else (output,)
    return total + sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))


class Chain(nn.Module):
    """k elementwise ops, the kind of tail a residual block or activation stack has."""

    OPS = (
        lambda t, y: t * y,
        lambda t, y: t + 1.0,
        lambda t, y: torch.relu(t),
        lambda t, y: t * 0.5,
        lambda t, y: t - y,
        lambda t, y: torch.sigmoid(t),
        lambda t, y: t * 2.0,
        lambda t, y: torch.tanh(t),
    )

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i in range(self.k):
            x = self.OPS[i % len(self.OPS)](x, y)
        return x


def _chain(k: int, n: int) -> Callable[[], tuple[nn.Module, tuple[Any, ...]]]:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        g = torch.Generator().manual_seed(0)
        return Chain(k).eval(), (torch.randn(n, generator=g), torch.randn(n, generator=g))

    return build


EIGHT_M = 8 << 20


def micro_cases() -> list[Case]:
    cases = [
        Case(
            f"elementwise chain {k} ops, 8M f32",
            "elementwise",
            _chain(k, EIGHT_M),
            quick=(k == 4),
            min_bytes=io_bytes,
        )
        for k in (2, 4, 8)
    ]
    return cases


def all_cases() -> list[Case]:
    return micro_cases()
