"""Channels-last layout for frozen convolution graphs: activations run NHWC between the
convolutions, callers get eager's layout back, and the pass declines where it must."""

from __future__ import annotations

import torch
import torch.nn as nn

import opfuse
from opfuse.context import Context
from opfuse.frontend.capture import capture_module
from opfuse.options import Options
from opfuse.pipeline import rewrite
from opfuse.rewrite.layout import is_channels_last
from tests.conftest import assert_matches_eager


class Net(nn.Module):
    def __init__(self, dims: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
        self.stem = conv(3, 16, 3, stride=2, padding=1)
        self.c1, self.b1 = conv(16, 16, 3, padding=1, bias=False), bn(16)
        self.c2 = conv(16, 16, 3, padding=1, groups=16)  # depthwise
        self.fc = nn.Linear(16, 10)
        self.b1.running_mean.uniform_(-0.5, 0.5)
        self.b1.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.relu(self.stem(x))
        f = torch.nn.functional.silu(self.c2(torch.relu(self.b1(self.c1(y)))) + y)
        dims = tuple(range(2, f.ndim))
        return self.fc(f.mean(dims)), f, f.reshape(f.shape[0], -1)


def test_conv_graph_runs_channels_last_and_returns_eager_layout() -> None:
    m, x = Net().eval(), torch.randn(2, 3, 32, 32)
    fast = opfuse.compile(m, (x,))
    assert "channels-last: 3 convolutions" in fast.report.layout
    got, ref = fast(x), m(x)
    assert_matches_eager(m, got, (x,))
    for a, b in zip(got, ref):
        assert a.stride() == b.stride()  # the feature map comes back NCHW
    graph = capture_module(m, (x,), {}).graph
    ctx = Context(Options(winograd=False))  # (3x3 ones would be Winograd's rows)
    new, note = rewrite(graph, ctx), ctx.layout
    convs = [n for n in new.nodes if n.op == "aten.convolution.default"]
    assert convs and all(is_channels_last(c.tensor) for c in convs)
    assert "channels-last" in note


def test_conv3d_runs_channels_last_too() -> None:
    m, x = Net(dims=3).eval(), torch.randn(1, 3, 8, 12, 12)
    fast = opfuse.compile(m, (x,))
    assert "3 convolutions" in fast.report.layout
    assert_matches_eager(m, fast(x), (x,))


def test_layout_can_be_kept() -> None:
    m, x = Net().eval(), torch.randn(2, 3, 16, 16)
    fast = opfuse.compile(m, (x,), options=Options(layout="keep"))
    assert fast.report.layout == ""
    assert_matches_eager(m, fast(x), (x,))


class Transposed(nn.Module):
    """Returns a view of a conv output whose layout a contiguous copy cannot reproduce."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c = nn.Conv2d(4, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.c(x)).transpose(1, 3)


def test_declines_when_an_output_layout_cannot_be_restored() -> None:
    m, x = Transposed().eval(), torch.randn(2, 4, 10, 10)
    fast = opfuse.compile(m, (x,))
    assert fast.report.layout.startswith("layout kept NCHW")
    got = fast(x)
    assert got.stride() == m(x).stride()
    assert_matches_eager(m, got, (x,))


def test_training_graphs_keep_their_layout() -> None:
    m = Net().train()
    x = torch.randn(2, 3, 16, 16)
    report = opfuse.explain(m, (x,))
    assert "channels-last" not in report.layout


def test_single_convolution_keeps_nchw() -> None:
    """Nothing to gain: the copy back to NCHW would cost more than the reorders it spares."""
    m, x = nn.Sequential(nn.Conv2d(8, 8, 3), nn.ReLU()).eval(), torch.randn(2, 8, 12, 12)
    fast = opfuse.compile(m, (x,))
    assert fast.report.layout.startswith("layout kept NCHW: channels-last would spare 0")
    assert fast.report.kernels_after == 1
    assert_matches_eager(m, fast(x), (x,))
