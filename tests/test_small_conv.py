"""Convolutions over a few input channels (an image's stem) as rows for opfuse's direct
kernel (rewrite/conv_rows.py, backends/c/small_conv.py): the kernel reads the input in
any layout, takes the convolution's epilogue, is measured against oneDNN's convolution,
and matches eager at every geometry, channel count and batch size."""

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

DENSE = "opfuse.conv_rows.default"
ACTS: dict[str, Any] = {"none": lambda t: t, "relu": torch.relu, "relu6": F.relu6, "silu": F.silu}


class _Stem(nn.Module):
    """conv -> BatchNorm (folded) -> activation, then a 3x3/2 convolution (the graph runs
    channels-last; a stride-1 one would be Winograd's rows: tests/test_winograd.py)."""

    def __init__(
        self,
        c: int,
        oc: int,
        k: tuple[int, int],
        stride: int,
        pad: int,
        dil: int,
        act: str,
        bias: bool,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, oc, k, stride, pad, dil, bias=bias)
        self.bn = nn.BatchNorm2d(oc)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 2.0)
        self.act = ACTS[act]
        self.next = nn.Conv2d(oc, 8, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.next(self.act(self.bn(self.conv(x))))


def _stem_groups(fast: Any) -> list[Any]:
    """The few-channel convolution's groups (not a Winograd one's)."""
    return [
        g for g in fast.report.groups if g.ops[0] == DENSE and "winograd" not in g.implementation
    ]


def test_an_rgb_stem_runs_as_rows_read_from_the_callers_image() -> None:
    torch.manual_seed(0)
    m = _Stem(3, 24, (3, 3), 2, 1, 1, "relu6", bias=False).eval()
    x = torch.randn(2, 3, 32, 30)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    (g,) = _stem_groups(fast)
    assert g.ops[:2] == [DENSE, "aten.hardtanh.default"]  # the folded BN's ReLU6 in it
    for name in ("opfuse-conv", "onednn"):  # measured against each other
        assert f"{name} " in g.implementation, g.implementation
    assert any("a convolution over 3 input channels" in n for n in fast.report.conv_rows)
    assert "1 over a few input channels" in str(fast.report)
    # the NCHW image is read where it is: nothing copies it first
    assert fast.report.groups[0] is g


@pytest.mark.parametrize("impl", ["opfuse-conv", "onednn", "unfused"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_every_implementation_and_layout_matches_eager(impl: str, layout: str) -> None:
    torch.manual_seed(1)
    m = _Stem(3, 40, (5, 5), 2, 2, 1, "silu", bias=True).eval()
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(2, 3, 17, 19).contiguous(memory_format=fmt)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
    for inp in (x, torch.randn(2, 3, 17, 19).contiguous(memory_format=fmt)):
        assert_matches_eager(m, fast(inp), (inp,))
    (g,) = _stem_groups(fast)
    refused = impl == "onednn" and "oneDNN: the epilogue is not a post-op" in g.implementation
    assert refused or g.implementation.split(" ")[0] == impl, g.implementation


def test_wide_windows_and_wide_inputs_keep_the_convolution() -> None:
    """A 9x9 window is past the kernel's taps: oneDNN and torch run it. Eight input
    channels are no stem: a 3x3 stride-1 convolution over them is Winograd's rows."""
    torch.manual_seed(2)
    m = _Stem(3, 16, (9, 9), 1, 4, 1, "relu", bias=True).eval()
    x = torch.randn(1, 3, 12, 12)
    fast = opfuse.compile(m, (x,))
    (g,) = _stem_groups(fast)
    assert "opfuse-conv: a 9x9 window" in g.implementation
    assert_matches_eager(m, fast(x), (x,))
    m = _Stem(8, 16, (3, 3), 1, 1, 1, "relu", bias=True).eval()
    x = torch.randn(1, 8, 12, 12)
    fast = opfuse.compile(m, (x,))
    assert not _stem_groups(fast)
    assert all("Winograd" in n for n in fast.report.conv_rows)
    assert_matches_eager(m, fast(x), (x,))


def test_new_batch_sizes_share_the_rows() -> None:
    torch.manual_seed(3)
    m = _Stem(3, 32, (7, 7), 2, 3, 1, "relu", bias=False).eval()
    opts = opfuse.Options(implementation="opfuse-conv")
    fast = opfuse.compile(m, (torch.randn(2, 3, 20, 20),), options=opts)
    for b in (3, 5):  # the second batch exports with a symbolic batch
        xb = torch.randn(b, 3, 20, 20)
        assert_matches_eager(m, fast(xb), (xb,))
    entries = fast._entries.values()  # type: ignore[attr-defined]
    assert all(_stem_groups(e)[0].implementation.startswith("opfuse-conv") for e in entries)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 2),
    c=st.integers(1, 4),
    oc=st.integers(1, 80),
    h=st.integers(1, 12),
    w=st.integers(1, 12),
    k=st.tuples(st.sampled_from([1, 2, 3, 5, 7]), st.sampled_from([2, 3, 4, 7])),
    stride=st.integers(1, 3),
    pad=st.integers(0, 3),
    dil=st.integers(1, 2),
    act=st.sampled_from(sorted(ACTS)),
    bias=st.booleans(),
    nhwc=st.booleans(),
)
def test_any_geometry_matches_eager(
    n: int,
    c: int,
    oc: int,
    h: int,
    w: int,
    k: tuple[int, int],
    stride: int,
    pad: int,
    dil: int,
    act: str,
    bias: bool,
    nhwc: bool,
) -> None:
    """Output channels in blocks of 64 and a partial last vector, windows at every border,
    non-square windows, strides and dilations, outputs of one pixel, either input layout."""
    if any(s + 2 * pad < dil * (kk - 1) + 1 for s, kk in ((h, k[0]), (w, k[1]))):
        return  # no output: torch refuses the shape
    torch.manual_seed(n * 100 + c * 10 + oc)
    m = _Stem(c, oc, k, stride, pad, dil, act, bias).eval()
    x = torch.randn(n, c, h, w)
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="opfuse-conv"))
    assert_matches_eager(m, fast(x), (x,))
    assert all(g.implementation.startswith("opfuse-conv") for g in _stem_groups(fast))
    # (the layout pass keeps tiny graphs NCHW: then no rows)
    assert _stem_groups(fast) or "layout kept NCHW" in str(fast.report)


@pytest.mark.parametrize("oc", [8, 20, 40, 72])
def test_the_kernels_without_avx512_match_eager(oc: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AVX-512 the direct and depthwise kernels take vectors of 8 channels (AVX2's
    16 registers): built here with -mno-avx512f whatever this CPU has. OC = 8..72: blocks
    of 1 to 4 vectors, a part-filled last one, a depthwise scalar tail (20, 72 % 16)."""
    import dataclasses

    from opfuse.backends.c import build

    native = build.toolchain()
    narrow = dataclasses.replace(native, flags=(*native.flags, "-mno-avx512f"))
    monkeypatch.setattr(build, "toolchain", lambda: narrow)
    torch.manual_seed(oc)
    stem = _Stem(3, oc, (3, 3), 2, 1, 1, "relu6", bias=True).eval()
    dw = nn.Sequential(
        nn.Conv2d(3, oc, 3, padding=1), nn.Conv2d(oc, oc, 3, padding=1, groups=oc), nn.ReLU()
    ).eval()
    x = torch.randn(2, 3, 15, 13)
    for m, impl in ((stem, "opfuse-conv"), (dw, "opfuse-dw")):
        fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
        assert_matches_eager(m, fast(x), (x,))
        assert any(g.implementation.startswith(impl) for g in fast.report.groups)
