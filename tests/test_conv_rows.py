"""Convolutions over channels-last input as rows (rewrite/conv_rows.py): a 1x1 one as a
matmul, a depthwise one as opfuse's depthwise kernel; either takes the convolution's
epilogue; every implementation, oneDNN's convolution itself among them, matches eager;
other convolutions are left alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import opfuse
from tests.conftest import assert_matches_eager

ACTS: dict[str, Any] = {
    "none": lambda t: t,
    "relu": torch.relu,
    "relu6": F.relu6,
    "silu": F.silu,
}


class _Block(nn.Module):
    """An inverted-residual tail: 3x3 conv, then the 1x1 conv under test (with BatchNorm to
    fold, an activation, and optionally the block input added back and a ReLU)."""

    def __init__(self, c: int, oc: int, act: str, residual: bool, bias: bool) -> None:
        super().__init__()
        self.spread = nn.Conv2d(c, c, 3, padding=1)
        self.pw = nn.Conv2d(c, oc, 1, bias=bias)
        self.bn = nn.BatchNorm2d(oc)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 2.0)
        self.act, self.residual = ACTS[act], residual and c == oc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn(self.pw(self.spread(x))))
        return torch.relu(y + x) if self.residual else y


def _groups(fast: Any) -> list[Any]:
    return [g for g in fast.report.groups if g.ops[0] in ("aten.addmm.default", "aten.mm.default")]


def test_a_1x1_convolution_runs_as_a_matmul_with_its_epilogue() -> None:
    torch.manual_seed(0)
    m = _Block(16, 32, "relu6", residual=False, bias=True).eval()
    x = torch.randn(2, 16, 10, 12)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    (g,) = _groups(fast)
    # the ReLU6 fused in, and the copy back to the NCHW layout eager returns
    assert g.ops == ["aten.addmm.default", "aten.hardtanh.default", "aten.clone.default"]
    assert len(fast.report.conv_rows) == 1 and "1x1 convolution" in fast.report.conv_rows[0]
    assert "convolutions over channels-last rows: 1 1x1 as matmuls" in str(fast.report)
    convs = [g for g in fast.report.groups if g.ops[0] == "aten.convolution.default"]
    assert len(convs) == 1  # the 3x3 one stays a convolution
    assert fast(x).stride() == m(x).stride()  # the caller still gets eager's layout


@pytest.mark.parametrize("impl", ["opfuse-gemm", "blocked", "onednn", "unfused"])
@pytest.mark.parametrize(
    "act,residual", [("none", False), ("relu", False), ("relu6", True), ("silu", True)]
)
def test_every_implementation_matches_eager(impl: str, act: str, residual: bool) -> None:
    """oneDNN runs the convolution the matmul stands for (post-ops read through the view
    and permute back to NCHW order); the GEMMs run the matmul."""
    torch.manual_seed(1)
    m = _Block(24, 24, act, residual, bias=False).eval()
    x = torch.randn(2, 24, 7, 9)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
    assert_matches_eager(m, fast(x), (x,))
    x2 = torch.randn(2, 24, 7, 9)  # other values, same plan
    assert_matches_eager(m, fast(x2), (x2,))
    (g,) = _groups(fast)
    # (oneDNN has no post-op for the copy back to NCHW that ends a bare convolution)
    refused = impl == "onednn" and "oneDNN: the epilogue is not a post-op" in g.implementation
    assert refused or g.implementation.split(" ")[0] == impl, g.implementation


def test_the_tuner_weighs_the_convolution_against_the_gemms() -> None:
    torch.manual_seed(2)
    block = _Block(32, 64, "relu", residual=False, bias=True)
    m = nn.Sequential(block, nn.Conv2d(64, 8, 3, padding=1)).eval()  # (no copy to NCHW)
    x = torch.randn(1, 32, 14, 14)
    fast = opfuse.compile(m, (x,))
    (g,) = _groups(fast)
    for name in ("onednn", "opfuse-gemm"):
        assert f"{name} " in g.implementation, g.implementation
    assert_matches_eager(m, fast(x), (x,))


@pytest.mark.parametrize("impl", ["onednn", "opfuse-gemm", "torch"])
def test_a_bare_1x1_convolution_between_convolutions(impl: str) -> None:
    """No epilogue: the matmul alone, or oneDNN's convolution handing its NHWC result on
    as the matmul's rows."""
    torch.manual_seed(6)
    m = nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 24, 1), nn.Conv2d(24, 4, 3, padding=1)
    ).eval()
    x = torch.randn(2, 8, 11, 7)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
    (g,) = _groups(fast)
    assert g.ops == ["aten.addmm.default"] and g.implementation.split(" ")[0] == impl
    assert_matches_eager(m, fast(x), (x,))


def test_onednn_adds_into_a_dead_residual() -> None:
    """oneDNN's candidate is the convolution with its sum post-op, which accumulates into
    the residual itself when that is a dead result of the graph's own."""
    from opfuse.runtime.execute import TorchStep

    class Tail(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.spread = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
            self.pw, self.down = nn.Conv2d(8, 16, 1), nn.Conv2d(8, 16, 3, padding=1)
            self.head = nn.Conv2d(16, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x0 = torch.relu(self.stem(x))
            y = self.pw(self.spread(x0))
            return self.head(torch.relu(y + self.down(x0)))

    torch.manual_seed(7)
    m, x = Tail().eval(), torch.randn(2, 3, 9, 9)
    # (the 3x3 ones as convolutions, not Winograd's rows: tests/test_winograd.py)
    opts = opfuse.Options(implementation="onednn", winograd=False)
    fast = opfuse.compile(m, (x,), options=opts)
    (g,) = _groups(fast)
    assert g.ops == ["aten.addmm.default", "aten.add.Tensor", "aten.relu.default"]
    steps = fast._first.compiled.run.plan.steps  # type: ignore[attr-defined]
    donating = [s.name for s in steps if isinstance(s, TorchStep) and s.donate is not None]
    assert donating == ["relu_1"]  # the tail's oneDNN call (its output: the ReLU's)
    for _ in range(2):
        assert_matches_eager(m, fast(x), (x,))


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(8, 16, 1, stride=2),
        nn.Conv2d(8, 16, 1, padding=1),
        nn.Conv2d(8, 16, 1, groups=2),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.Conv2d(8, 16, 1, dilation=2),
    ],
    ids=["stride", "padding", "groups", "3x3 stride 2", "dilation"],
)
def test_other_convolutions_stay_convolutions(conv: nn.Module) -> None:
    torch.manual_seed(3)
    m = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), conv, nn.ReLU()).eval()
    x = torch.randn(2, 8, 9, 9)
    fast = opfuse.compile(m, (x,))
    assert not fast.report.conv_rows and not _groups(fast)
    assert_matches_eager(m, fast(x), (x,))


def test_nchw_graphs_and_the_switch_keep_the_convolution() -> None:
    torch.manual_seed(4)
    m = _Block(8, 8, "relu", residual=True, bias=True).eval()
    x = torch.randn(2, 8, 6, 6)
    for opts in (opfuse.Options(layout="keep"), opfuse.Options(conv_rows=False)):
        fast = opfuse.compile(m, (x,), options=opts)
        assert not fast.report.conv_rows and not _groups(fast)
        assert_matches_eager(m, fast(x), (x,))


def test_new_batch_sizes_share_the_rewrite() -> None:
    """opfuse.compile over batch sizes (one export with a symbolic batch): the rows of the
    matmul scale with it."""
    torch.manual_seed(5)
    m = _Block(16, 16, "relu6", residual=True, bias=True).eval()
    fast = opfuse.compile(m, (torch.randn(2, 16, 8, 8),))
    for b in (3, 5, 4):
        x = torch.randn(b, 16, 8, 8)
        assert_matches_eager(m, fast(x), (x,))
    assert all(e.report.conv_rows for e in fast._entries.values())  # type: ignore[attr-defined]


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 3),
    c=st.integers(1, 40),
    oc=st.integers(1, 40),
    h=st.integers(1, 9),
    w=st.integers(1, 9),
    act=st.sampled_from(sorted(ACTS)),
    residual=st.booleans(),
    bias=st.booleans(),
    impl=st.sampled_from([None, "opfuse-gemm", "onednn", "blocked"]),
)
def test_any_shape_matches_eager(
    n: int, c: int, oc: int, h: int, w: int, act: str, residual: bool, bias: bool, impl: Any
) -> None:
    torch.manual_seed(n * 1000 + c * 40 + oc)
    m = _Block(c, oc, act, residual, bias).eval()
    x = torch.randn(n, c, h, w)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
    assert_matches_eager(m, fast(x), (x,))


class _SqueezeExcite(nn.Module):
    """conv -> ReLU -> x * hardsigmoid(conv1x1(relu(conv1x1(mean over H, W)))) -> conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 32, 3, padding=1)
        self.fc1, self.fc2 = nn.Conv2d(32, 8, 1), nn.Conv2d(8, 32, 1)
        self.out = nn.Conv2d(32, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        s = self.fc2(torch.relu(self.fc1(F.adaptive_avg_pool2d(y, 1))))
        return self.out(y * F.hardsigmoid(s))


@pytest.mark.parametrize("batch", [1, 3])
def test_squeeze_excite_1x1_convolutions_over_pooled_images_are_matmuls(batch: int) -> None:
    """A [N, C, 1, 1] tensor is NCHW and NHWC alike: its 1x1 convolutions become matmuls
    (they were oneDNN calls, ~20 us each, 16 of them in MobileNetV3-Large)."""
    torch.manual_seed(14)
    m = _SqueezeExcite().eval()
    x = torch.randn(batch, 8, 9, 9)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    assert sum("1x1 convolution" in n for n in fast.report.conv_rows) == 2
    assert len(_groups(fast)) == 2
    convs = [g for g in fast.report.groups if g.ops[0] == "aten.convolution.default"]
    assert len(convs) == 1  # the 3x3 one over the caller's NCHW image
    # the one over channels-last rows: Winograd's (tests/test_winograd.py)
    assert sum("Winograd" in n for n in fast.report.conv_rows) == 1


# -- depthwise ---------------------------------------------------------------------------------
DEPTHWISE = "opfuse.depthwise_rows.default"


class _Depthwise(nn.Module):
    def __init__(self, c: int, k: int, stride: int, pad: int, dil: int, act: str, bias: bool):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)  # the graph runs channels-last after it
        self.dw = nn.Conv2d(c, c, k, stride, pad, dil, groups=c, bias=bias)
        self.bn = nn.BatchNorm2d(c)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 2.0)
        self.act = ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.dw(self.stem(x))))


def _depthwise_groups(fast: Any) -> list[Any]:
    return [g for g in fast.report.groups if g.ops[0] == DEPTHWISE]


def test_a_depthwise_convolution_runs_as_rows_with_its_epilogue() -> None:
    torch.manual_seed(8)
    block = _Depthwise(32, 3, 1, 1, 1, "relu6", bias=False)
    m = nn.Sequential(block, nn.Conv2d(32, 8, 3)).eval()  # (no copy back to NCHW)
    x = torch.randn(2, 3, 12, 10)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    (g,) = _depthwise_groups(fast)
    assert g.ops[:2] == [DEPTHWISE, "aten.hardtanh.default"]  # the folded BN's ReLU6 in it
    for name in ("opfuse-dw", "onednn"):  # measured against each other
        assert f"{name} " in g.implementation, g.implementation
    assert any("depthwise convolution" in n for n in fast.report.conv_rows)


@pytest.mark.parametrize("impl", ["opfuse-dw", "onednn", "unfused"])
@pytest.mark.parametrize("act", ["none", "relu6", "silu"])
def test_every_depthwise_implementation_matches_eager(impl: str, act: str) -> None:
    torch.manual_seed(9)
    m = _Depthwise(24, 3, 2, 1, 1, act, bias=True).eval()
    x = torch.randn(2, 3, 11, 9)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
    for inp in (x, torch.randn(2, 3, 11, 9)):
        assert_matches_eager(m, fast(inp), (inp,))
    (g,) = _depthwise_groups(fast)
    refused = impl == "onednn" and "oneDNN: the epilogue is not a post-op" in g.implementation
    assert refused or g.implementation.split(" ")[0] == impl, g.implementation


@pytest.mark.parametrize("impl", ["opfuse-dw", "onednn", "torch"])
def test_a_bare_depthwise_convolution_between_convolutions(impl: str) -> None:
    torch.manual_seed(10)
    m = nn.Sequential(
        nn.Conv2d(4, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 5, padding=2, groups=16),
        nn.Conv2d(16, 4, 3),
    ).eval()
    x = torch.randn(2, 4, 13, 13)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
    (g,) = _depthwise_groups(fast)
    assert g.ops == [DEPTHWISE] and g.implementation.split(" ")[0] == impl, g.implementation
    assert_matches_eager(m, fast(x), (x,))


def test_wide_windows_keep_the_other_candidates_and_batches_share_the_rewrite() -> None:
    """A 9x9 window is past the kernel's registers: oneDNN's convolution and torch's run
    instead, correctly. New batch sizes (one export with a symbolic batch) match eager."""
    torch.manual_seed(11)
    m = _Depthwise(16, 9, 1, 4, 1, "relu", bias=True).eval()
    x = torch.randn(1, 3, 12, 12)
    fast = opfuse.compile(m, (x,))
    (g,) = _depthwise_groups(fast)
    assert "opfuse-dw: a 9x9 window" in g.implementation
    assert_matches_eager(m, fast(x), (x,))
    m = _Depthwise(16, 3, 1, 1, 1, "relu6", bias=True).eval()
    fast = opfuse.compile(m, (torch.randn(2, 3, 8, 8),))
    for b in (3, 5):  # the second batch exports with a symbolic batch
        xb = torch.randn(b, 3, 8, 8)
        assert_matches_eager(m, fast(xb), (xb,))
    assert all(_depthwise_groups(e) for e in fast._entries.values())  # type: ignore[attr-defined]


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 2),
    c=st.integers(1, 40),
    h=st.integers(1, 12),
    w=st.integers(1, 12),
    k=st.sampled_from([1, 3, 5, 7]),
    stride=st.integers(1, 3),
    pad=st.integers(0, 3),
    dil=st.integers(1, 2),
    act=st.sampled_from(sorted(ACTS)),
    bias=st.booleans(),
)
def test_any_depthwise_geometry_matches_eager(
    n: int, c: int, h: int, w: int, k: int, stride: int, pad: int, dil: int, act: str, bias: bool
) -> None:
    """Channels no multiple of 16 (the scalar tail), windows at every border, strides and
    dilations, outputs of one pixel."""
    if h + 2 * pad < dil * (k - 1) + 1 or w + 2 * pad < dil * (k - 1) + 1:
        return  # no output: torch refuses the shape
    torch.manual_seed(n * 100 + c)
    m = _Depthwise(c, k, stride, pad, dil, act, bias).eval()
    x = torch.randn(n, 3, h, w)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="opfuse-dw"))
    assert_matches_eager(m, fast(x), (x,))


def test_padding_valid_and_same() -> None:
    """torch.export leaves padding="valid" as one value for both dims ([0]); it compiled
    to an IndexError (EfficientNet's blocks) before the rewrite read it as a pair."""
    torch.manual_seed(12)
    m = nn.Sequential(
        nn.Conv2d(4, 16, 3, padding=1),
        nn.Conv2d(16, 16, 3, padding="valid", groups=16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding="same", groups=16),
        nn.Conv2d(16, 4, 3),
    ).eval()
    x = torch.randn(2, 4, 12, 12)
    fast = opfuse.compile(m, (x,))
    assert len(_depthwise_groups(fast)) == 2 and not fast.report.warnings
    assert_matches_eager(m, fast(x), (x,))


class _TfPadded(nn.Module):
    """Hugging Face's MobileNets pad for TensorFlow's "same": zeros on one side more than
    the other before a strided depthwise convolution, a padding of nothing before a 1x1."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, 2, groups=16)
        self.pw = nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(F.pad(torch.relu(self.stem(x)), (0, 1, 0, 1)))
        return self.pw(F.pad(F.relu6(y), (0, 0, 0, 0)))


@pytest.mark.parametrize("impl", [None, "opfuse-dw", "torch", "opfuse-dw-gemm"])
def test_zero_padding_before_a_convolution_is_its_own(impl: str | None) -> None:
    torch.manual_seed(13)
    m = _TfPadded().eval()
    x = torch.randn(2, 3, 13, 12)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
    assert_matches_eager(m, fast(x), (x,))
    notes = [n for n in fast.report.conv_rows if "input channels" not in n]  # (the stem)
    assert len(notes) == 2 and all("zero padding before it folded in" in n for n in notes)
    ops = {op for g in fast.report.groups for op in g.ops}
    assert "aten.constant_pad_nd.default" not in ops  # no copy made for either pad
    (g,) = _depthwise_groups(fast)
    # oneDNN's convolution pads both sides alike: no candidate for these rows
    assert "onednn " not in g.implementation
