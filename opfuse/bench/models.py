"""Models written with torch.nn for the demo and the benchmarks (no downloads)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


class ResidualMLPBlock(nn.Module):
    """Pre-norm Transformer MLP block with a softmax head: LayerNorm(x + r), GELU MLP,
    residual add."""

    def __init__(self, dim: int = 768, hidden: int = 3072, classes: int = 1000) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = x + residual
        y = self.fc2(self.act(self.fc1(self.norm(h)))) + h
        return torch.softmax(self.head(y) * 0.5, dim=-1)


def demo_model() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    m = ResidualMLPBlock().eval()
    return m, (torch.randn(256, 768), torch.randn(256, 768))
