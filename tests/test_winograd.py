"""3x3, stride-1 convolutions over channels-last input as rows for opfuse's Winograd kernel
(rewrite/conv_rows.py, lower/depthwise.py, backends/c/winograd.py): F(2x2, 3x3) in tasks
of output rows x channel blocks, the epilogue in cache, measured against oneDNN's
convolution; eager's results at every geometry, no further from float64 than eager's,
and eager's infinities and NaN."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import opfuse
from opfuse.backends.c.winograd import pack_winograd
from tests.conftest import assert_matches_eager

DENSE = "opfuse.conv_rows.default"
ACTS: dict[str, Any] = {"none": lambda t: t, "relu": torch.relu, "relu6": F.relu6, "silu": F.silu}
WINOGRAD = opfuse.Options(implementation="opfuse-winograd")


class _Block(nn.Module):
    """A stem (the graph runs channels-last after it), then conv 3x3 -> BatchNorm (folded)
    -> activation (+ the stem's output, where the channels agree)."""

    def __init__(
        self, c: int, oc: int, pad: int, act: str, bias: bool, residual: bool = False
    ) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)  # opfuse's direct kernel: NHWC after it
        self.conv = nn.Conv2d(c, oc, 3, padding=pad, bias=bias)
        self.bn = nn.BatchNorm2d(oc)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 2.0)
        self.act = ACTS[act]
        self.residual = residual and c == oc and pad == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = self.stem(x)
        y = self.act(self.bn(self.conv(x0)))
        return y + x0 if self.residual else y


def _winograd_groups(fast: Any) -> list[Any]:
    return [g for g in fast.report.groups if g.ops[0] == DENSE and "winograd" in g.implementation]


def test_a_3x3_convolution_runs_as_winograd_rows_with_its_epilogue() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(_Block(16, 16, 1, "relu", bias=True), nn.Conv2d(16, 8, 1)).eval()
    x = torch.randn(2, 3, 20, 18)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    (g,) = _winograd_groups(fast)
    assert g.ops == [DENSE, "aten.relu.default"]  # the folded BN's ReLU in it
    for name in ("opfuse-winograd", "onednn"):  # measured against each other
        assert f"{name} " in g.implementation, g.implementation
    assert sum("Winograd F(2x2, 3x3)" in n for n in fast.report.conv_rows) == 1
    assert "1 3x3 for Winograd" in str(fast.report)


@pytest.mark.parametrize("impl", ["opfuse-winograd", "onednn", "unfused"])
def test_every_implementation_matches_eager(impl: str) -> None:
    torch.manual_seed(1)
    m = _Block(24, 40, 1, "silu", bias=True).eval()
    x = torch.randn(2, 3, 11, 13)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
    for inp in (x, torch.randn(2, 3, 11, 13)):
        assert_matches_eager(m, fast(inp), (inp,))


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 3),
    c=st.integers(5, 40),
    oc=st.integers(1, 150),
    h=st.integers(1, 13),
    w=st.integers(1, 13),
    pad=st.integers(0, 2),
    act=st.sampled_from(sorted(ACTS)),
    bias=st.booleans(),
    residual=st.booleans(),
)
def test_any_geometry_matches_eager(
    n: int, c: int, oc: int, h: int, w: int, pad: int, act: str, bias: bool, residual: bool
) -> None:
    """Odd and even sizes (the last 2x2 tiles cut short), outputs of one pixel, every
    padding, channel blocks of 128 and partial GEMM panels, tasks over several images,
    no epilogue (tiles in the output) or one."""
    if min(h, w) + 2 * pad < 3:
        return  # no output: torch refuses the shape
    torch.manual_seed(n * 1000 + c * 10 + oc)
    m = _Block(c, oc, pad, act, bias, residual).eval()
    x = torch.randn(n, 3, h, w)
    fast = opfuse.compile(m, (x,), options=WINOGRAD)
    assert_matches_eager(m, fast(x), (x,))
    groups = _winograd_groups(fast)
    # (the layout pass keeps tiny graphs NCHW, and a 1-channel or 1-pixel output is NCHW
    # as much as NHWC: then no rows)
    assert groups or "layout kept NCHW" in str(fast.report) or min(oc, h, w) == 1
    assert all(g.implementation.startswith("opfuse-winograd") for g in groups)


def test_new_batch_sizes_share_the_winograd_kernel() -> None:
    """opfuse.compile over batch sizes (one export with a symbolic batch): the tasks scale
    with the batch, the image sizes stay constants."""
    torch.manual_seed(6)
    m = nn.Sequential(_Block(16, 24, 1, "relu", bias=True), nn.Conv2d(24, 8, 1)).eval()
    fast = opfuse.compile(m, (torch.randn(2, 3, 12, 10),), options=WINOGRAD)
    for b in (3, 5, 1):  # the second batch exports with a symbolic batch
        xb = torch.randn(b, 3, 12, 10)
        assert_matches_eager(m, fast(xb), (xb,))
    entries = list(fast._entries.values())  # type: ignore[attr-defined]
    assert len(entries) >= 2
    assert all(_winograd_groups(e) for e in entries)


def test_no_further_from_float64_than_eager() -> None:
    """B^T and A^T add and subtract, G halves: the sums over channels are the GEMM's
    (three levels), shorter chains than a direct convolution's 9 x C."""
    torch.manual_seed(2)
    m = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.Conv2d(64, 64, 3, padding=1)).eval()
    x = torch.randn(1, 3, 28, 28)
    fast = opfuse.compile(m, (x,), options=WINOGRAD)
    assert _winograd_groups(fast)
    ref64 = copy.deepcopy(m).double()(x.double())  # (m.double() would move m's data)
    ours = (fast(x).double() - ref64).abs()
    eager = (m(x).double() - ref64).abs()
    assert ours.max() <= eager.max() and ours.mean() <= eager.mean()


@pytest.mark.parametrize("where", ["inf", "-inf", "nan", "huge"])
def test_infinities_and_nan_give_eagers_results(where: str) -> None:
    """inf - inf in the transforms is NaN where the direct sums are +-inf: a task with an
    output that is not finite computes its outputs again by direct sums, as eager's."""
    torch.manual_seed(3)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
    m = m.eval()
    x = torch.randn(2, 3, 9, 10)
    with torch.no_grad():  # the weights all positive: one inf gives inf, not NaN, in eager
        m[0].weight.abs_()
        m[1].weight.abs_()
    if where == "huge":  # finite, but the transforms' sums overflow
        x = x.abs() * 3e37
    else:
        x[0, 1, 4, 5] = x[1, 0, 0, 0] = x[1, 2, 8, 9] = float(where)
    fast = opfuse.compile(m, (torch.randn(2, 3, 9, 10),), options=WINOGRAD)
    assert _winograd_groups(fast)
    got, want = fast(x), m(x)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()], want[want.isinf()])
    finite = got.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-5)


def test_other_convolutions_and_the_switch_keep_the_convolution() -> None:
    torch.manual_seed(4)
    for conv in (
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.Conv2d(8, 16, 3, padding=2, dilation=2),
        nn.Conv2d(8, 16, 3, padding=1, groups=2),
        nn.Conv2d(8, 16, 5, padding=2),
    ):
        m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), conv, nn.ReLU()).eval()
        x = torch.randn(2, 3, 9, 9)
        fast = opfuse.compile(m, (x,))
        assert not _winograd_groups(fast), conv
        assert not any("Winograd" in n for n in fast.report.conv_rows)
        assert_matches_eager(m, fast(x), (x,))
    m = _Block(16, 16, 1, "relu", bias=True).eval()
    x = torch.randn(1, 3, 10, 10)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(winograd=False))
    assert not _winograd_groups(fast) and not any("Winograd" in n for n in fast.report.conv_rows)
    assert_matches_eager(m, fast(x), (x,))


def test_the_filters_transform_is_lavin_and_grays() -> None:
    """U = G g G^T, in panels of 32 output channels; the bias, then the filters as given
    (for the direct sums) after it."""
    torch.manual_seed(5)
    w, b = torch.randn(40, 6, 3, 3), torch.randn(40)
    packed = pack_winograd(w, b)
    g = torch.tensor([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=torch.float64)
    u = (g @ w.double() @ g.T).float()  # [40, 6, 4, 4]
    ocp = 64
    # panels of 32 channels: the first 16 for every input channel, then the other 16
    panels = packed[: 16 * 6 * ocp].reshape(16, ocp // 32, 2, 6, 16)
    k = panels.permute(0, 3, 1, 2, 4).reshape(16, 6, ocp)  # [xi, C, OCP]
    assert torch.equal(k[:, :, :40], u.permute(2, 3, 1, 0).reshape(16, 6, 40))
    assert not k[:, :, 40:].any()
    rest = packed[16 * 6 * ocp :]
    assert torch.equal(rest[:40], b) and not rest[40:ocp].any()
    assert torch.equal(rest[ocp:], w.reshape(-1))
