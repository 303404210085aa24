"""Factories the CLI tests load with `opfuse explain MODULE:FACTORY`."""

import torch.nn as nn

from opfuse.bench.models import Bottleneck, realistic


def resnet_block() -> nn.Module:
    return realistic(Bottleneck(32, 8))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).eval()


def broken() -> nn.Module:
    raise ValueError("this factory fails")
