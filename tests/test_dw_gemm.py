"""A depthwise convolution's rows fed straight into the 1x1 convolution's matmul that reads
them (lower/dw_gemm.py): one kernel for both groups, timed against the two run apart; with
the expansion before it, one kernel for MobileNet's inverted residual block, and, with a
squeeze-and-excitation block after the depthwise convolution, the expansion inside the
depthwise kernel; every shape matches eager; values anyone else reads keep the groups
apart."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import opfuse
from opfuse.rewrite.conv_rows import DEPTHWISE
from opfuse.runtime.execute import TorchStep
from tests.conftest import assert_matches_eager

FUSED = opfuse.Options(implementation="opfuse-dw-gemm")
BLOCK = opfuse.Options(implementation="opfuse-expand-dw-gemm")


class _Tail(nn.Module):
    """An inverted residual block's tail: depthwise convolution (an activation after it or
    none), then the 1x1 projection, the block input added back where the shapes allow."""

    def __init__(
        self,
        c: int,
        oc: int,
        k: int = 3,
        stride: int = 1,
        dil: int = 1,
        act: bool = True,
        bias: bool = True,
        residual: bool = True,
    ) -> None:
        super().__init__()
        pad = dil * (k - 1) // 2
        self.dw = nn.Conv2d(c, c, k, stride, pad, dilation=dil, groups=c, bias=bias)
        self.pw = nn.Conv2d(c, oc, 1, bias=bias)
        self.act = act
        self.residual = residual and c == oc and stride == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x)
        y = self.pw(F.relu6(y) if self.act else y)
        return y + x if self.residual else y


def _nhwc(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(memory_format=torch.channels_last)


def _checked(m: nn.Module, shape: tuple[int, ...], options: Any) -> tuple[Any, torch.Tensor]:
    """m compiled with `options` on an input of `shape`, and its results on that input and
    on a second one matched against eager; (the compiled module, the first input)."""
    x = _nhwc(*shape)
    fast = opfuse.compile(m, (x,), options=options)
    for inp in (x, _nhwc(*shape)):
        assert_matches_eager(m, fast(inp), (inp,))
    return fast, x


def _fused(fast: Any) -> tuple[Any, Any]:
    """The depthwise group and the group whose kernel runs it."""
    groups = fast.report.groups
    (dw,) = [g for g in groups if g.ops[0] == DEPTHWISE]
    (mm,) = [g for g in groups if g.ops[0] in ("aten.addmm.default", "aten.mm.default")]
    return dw, mm


def test_the_depthwise_rows_run_inside_the_matmul_kernel() -> None:
    torch.manual_seed(0)
    m = _Tail(32, 32).eval()
    fast, _ = _checked(m, (2, 32, 15, 13), FUSED)
    dw, mm = _fused(fast)
    assert dw.kernel == f"(in group {mm.id})" and dw.implementation.startswith("inside group")
    assert dw.ops == [DEPTHWISE, "aten.hardtanh.default"]
    assert mm.ops == ["aten.addmm.default", "aten.add.Tensor"]  # the residual in its epilogue
    assert mm.implementation.startswith("opfuse-dw-gemm"), mm.implementation
    assert "opfuse_dw_gemm" in mm.kernel and "opfuse_gemm_tile(atile" in mm.source_code
    assert fast.report.kernels_after == 1  # one launch for the depthwise, ReLU6, 1x1 and add
    assert "depthwise_rows" in dw.intermediates_saved  # the rows never reach memory
    assert not fast.report.rejected  # (the partition kept them apart; the kernel did not)


def test_the_tuner_times_the_pair_against_the_groups_apart() -> None:
    torch.manual_seed(1)
    m = _Tail(48, 24, residual=False).eval()
    x = _nhwc(1, 48, 14, 14)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    dw, mm = _fused(fast)
    if dw.kernel.startswith("(in group"):  # the pair won: both times are in the report
        assert "opfuse-dw-gemm " in mm.implementation and "separate " in mm.implementation
    else:  # apart: each group as it was chosen
        assert not mm.implementation.startswith("opfuse-dw-gemm")
    again = opfuse.compile(m, (x,))  # the decision is remembered
    assert _fused(again)[0].kernel == dw.kernel
    assert_matches_eager(m, again(x), (x,))


@pytest.mark.parametrize(
    "kw",
    [
        {"act": False},  # the depthwise rows go to the matmul as they are
        {"bias": False, "residual": False},  # the matmul's tile is the output itself
        {"stride": 2},
        {"k": 5, "dil": 2},
        {"k": 7},
    ],
)
def test_shapes_and_epilogues(kw: dict[str, Any]) -> None:
    torch.manual_seed(2)
    m = _Tail(20, 40, **kw).eval()  # 20 channels: the scalar tail; 40 columns: a part panel
    x = _nhwc(3, 20, 11, 9)
    fast = opfuse.compile(m, (x,), options=FUSED)
    assert_matches_eager(m, fast(x), (x,))
    dw, mm = _fused(fast)
    assert dw.kernel == f"(in group {mm.id})"


class _Shared(nn.Module):
    """The depthwise rows also returned, or read by a second matmul."""

    def __init__(self, returned: bool) -> None:
        super().__init__()
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.a = nn.Conv2d(16, 8, 1)
        self.b = nn.Conv2d(16, 8, 1)
        self.returned = returned

    def forward(self, x: torch.Tensor) -> Any:
        y = F.relu(self.dw(x))
        return (self.a(y), y) if self.returned else self.a(y) + self.b(y)


class _Scaled(nn.Module):
    """The depthwise epilogue reads a tensor of its own (a per-channel scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(24, 24, 3, padding=1, groups=24)
        self.scale = nn.Parameter(torch.rand(24, 1, 1) + 0.5)
        self.pw = nn.Conv2d(24, 24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pw(F.silu(self.dw(x)) * self.scale) + x


def test_a_depthwise_epilogue_with_inputs_of_its_own() -> None:
    torch.manual_seed(4)
    m = _Scaled().eval()
    x = _nhwc(2, 24, 10, 7)
    fast = opfuse.compile(m, (x,), options=FUSED)
    assert_matches_eager(m, fast(x), (x,))
    dw, mm = _fused(fast)
    assert dw.kernel == f"(in group {mm.id})" and "aten.mul.Tensor" in dw.ops


@pytest.mark.parametrize("returned", [True, False])
def test_rows_read_by_others_keep_the_groups_apart(returned: bool) -> None:
    torch.manual_seed(3)
    m = _Shared(returned).eval()
    x = _nhwc(2, 16, 9, 9)
    fast = opfuse.compile(m, (x,), options=FUSED)
    assert_matches_eager(m, fast(x), (x,))
    assert not any(g.kernel.startswith("(in group") for g in fast.report.groups)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 2),
    c=st.integers(1, 40),
    oc=st.integers(1, 70),
    h=st.integers(1, 12),
    w=st.integers(1, 12),
    k=st.sampled_from([1, 3, 5]),
    stride=st.integers(1, 2),
    act=st.booleans(),
    bias=st.booleans(),
)
def test_any_shape_matches_eager(
    n: int, c: int, oc: int, h: int, w: int, k: int, stride: int, act: bool, bias: bool
) -> None:
    torch.manual_seed(n * 1000 + c * 10 + oc)
    m = _Tail(c, oc, k, stride, 1, act, bias).eval()
    x = _nhwc(n, c, h, w)
    fast = opfuse.compile(m, (x,), options=FUSED)
    assert_matches_eager(m, fast(x), (x,))


class _Inverted(nn.Module):
    """MobileNetV2's inverted residual block: 1x1 expansion, depthwise, 1x1 projection."""

    def __init__(
        self, c: int, t: int, oc: int, k: int = 3, stride: int = 1, dil: int = 1, act: Any = None
    ) -> None:
        super().__init__()
        hid = c * t
        self.expand = nn.Conv2d(c, hid, 1)
        self.tail = _Tail(hid, oc, k, stride, dil, residual=False)
        self.act = act or F.relu6
        self.residual = c == oc and stride == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tail(self.act(self.expand(x)))
        return y + x if self.residual else y


def _block(fast: Any) -> Any:
    """The group whose kernel runs the whole block; the two before it run inside it."""
    groups = fast.report.groups
    (last,) = [g for g in groups if not g.kernel.startswith("(in group")]
    inside = [g for g in groups if g.kernel == f"(in group {last.id})"]
    assert len(inside) == 2, [g.kernel for g in groups]
    return last


def test_an_inverted_residual_block_runs_as_one_kernel() -> None:
    torch.manual_seed(5)
    m = _Inverted(16, 6, 16).eval()
    fast, x = _checked(m, (2, 16, 15, 13), BLOCK)
    last = _block(fast)
    assert last.implementation.startswith("opfuse-expand-dw-gemm"), last.implementation
    assert last.ops[:2] == ["aten.addmm.default", "aten.add.Tensor"]
    assert "expansion, then depthwise" in last.source_code
    assert fast.report.kernels_after == 1 and not fast.report.rejected
    # measured against the groups as chosen (with the depthwise and projection paired)
    tuned = opfuse.compile(m, (x,))
    assert_matches_eager(m, tuned(x), (x,))
    g = [g for g in tuned.report.groups if not g.kernel.startswith("(in group")][-1]
    if g.implementation.startswith("opfuse-expand-dw-gemm"):
        assert "separate " in g.implementation


@pytest.mark.parametrize(
    "kw",
    [
        {"stride": 2},  # bands of two input rows per output row
        {"k": 5, "dil": 2},  # windows reaching four rows past the band
        {"act": F.silu},
        {"act": F.hardswish, "k": 7},
    ],
)
def test_blocks_of_every_shape(kw: dict[str, Any]) -> None:
    torch.manual_seed(6)
    m = _Inverted(8, 3, 12, **kw).eval()  # 24 channels: a part vector; 12 columns
    x = _nhwc(3, 8, 17, 11)
    fast = opfuse.compile(m, (x,), options=BLOCK)
    assert_matches_eager(m, fast(x), (x,))
    _block(fast)


def test_an_expansion_read_by_others_keeps_the_pair_only() -> None:
    class _Both(_Inverted):
        def forward(self, x: torch.Tensor) -> Any:
            e = F.relu6(self.expand(x))
            return self.tail(e), e.mean()

    torch.manual_seed(7)
    m = _Both(8, 2, 8).eval()
    x = _nhwc(1, 8, 9, 9)
    fast = opfuse.compile(m, (x,), options=BLOCK)
    assert_matches_eager(m, fast(x), (x,))
    assert not any(g.implementation.startswith("opfuse-expand") for g in fast.report.groups)


@settings(max_examples=30, deadline=None)
@given(
    excited=st.booleans(),  # a squeeze-and-excitation block (opfuse-expand-dw) or not
    n=st.integers(1, 3),
    c=st.integers(1, 12),
    t=st.integers(1, 6),
    oc=st.integers(1, 40),
    h=st.integers(1, 14),
    w=st.integers(1, 14),
    k=st.sampled_from([1, 3, 5]),
    stride=st.integers(1, 2),
)
def test_any_block_matches_eager(
    excited: bool, n: int, c: int, t: int, oc: int, h: int, w: int, k: int, stride: int
) -> None:
    torch.manual_seed(n * 1000 + c * 100 + oc)
    block = _Excited if excited else _Inverted
    m = block(c, t, oc, k, stride).eval()
    x = _nhwc(n, c, h, w)
    fast = opfuse.compile(m, (x,), options=EXPAND_DW if excited else BLOCK)
    assert_matches_eager(m, fast(x), (x,))


class _Chain(nn.Module):
    """MobileNetV1: depthwise and 1x1 convolutions in turn. Each 1x1 is both a pair's
    projection and the next triple's expansion: a group's work is done once, by one kernel."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for c in (8, 16, 16):
            layers += [nn.Conv2d(c, c, 3, padding=1, groups=c), nn.ReLU6()]
            layers += [nn.Conv2d(c, 16, 1), nn.ReLU6()]
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("options", [BLOCK, FUSED, None])
def test_a_chain_of_blocks_runs_each_group_once(options: Any) -> None:
    torch.manual_seed(8)
    m = _Chain().eval()
    x = _nhwc(2, 8, 12, 10)
    fast = opfuse.compile(m, (x,), options=options)
    assert_matches_eager(m, fast(x), (x,))
    groups = {g.id: g for g in fast.report.groups}
    for g in groups.values():
        if g.kernel.startswith("(in group"):
            into = groups[int(g.kernel.split()[-1].rstrip(")"))]
            assert not into.kernel.startswith("(in group"), (g.kernel, into.kernel)
    # nothing a kernel was to compute left to torch: no torch step computes a value of a
    # group run inside another's kernel (a group the tuner gave torch's call may have one)
    absorbed = {n for g in groups.values() if g.kernel.startswith("(in group") for n in g.nodes}
    steps = fast._first.compiled.run.plan.steps  # type: ignore[attr-defined]
    assert not any(isinstance(s, TorchStep) and s.name in absorbed for s in steps)
    assert fast.report.kernels_after == sum(
        1 for g in groups.values() if not g.kernel.startswith("(in group")
    )


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 8),
    h=st.integers(1, 240),
    c=st.sampled_from([8, 16, 96, 144, 384, 960]),
    k=st.sampled_from([1, 3, 5, 7]),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    out=st.sampled_from([16, 24, 64, 160, 320]),
    threads=st.integers(1, 16),
)
def test_band_height_is_the_search_it_closes(
    n: int, h: int, c: int, k: int, stride: int, dilation: int, out: int, threads: int
) -> None:
    """The band's closed form (one expression for every size) is the tallest band the
    search from a band per thread down finds."""
    from opfuse.lower.depthwise import Geometry
    from opfuse.lower.dw_gemm import band_floats, band_height

    span = (k - 1) * dilation + 1
    oh = (h + 2 * (k // 2) - span) // stride + 1
    if oh < 1:
        return
    g = Geometry(n, h, h, c, oh, oh, k, k, stride, stride, k // 2, k // 2, dilation, dilation)
    band = max(1, min(g.oh, -(-g.n * g.oh // threads)))

    def floats(b: int) -> int:
        reach = min(g.h, (b - 1) * g.sh + (g.kh - 1) * g.dh + 1)
        return reach * g.w * g.c + b * g.ow * (2 * g.c + out)

    while band > 1 and floats(band) > band_floats():
        band -= 1
    assert band_height(g, 2 * c + out, threads) == band


class _Excited(nn.Module):
    """MobileNetV3's / EfficientNet's block: 1x1 expansion, depthwise, squeeze-and-excitation
    (the depthwise result's mean scales it), 1x1 projection. No matmul reads the depthwise
    rows alone, so only the expansion can join the depthwise kernel."""

    def __init__(
        self,
        c: int,
        t: int,
        oc: int,
        k: int = 3,
        stride: int = 1,
        act: Any = F.hardswish,
        dw_act: Any = None,
    ) -> None:
        super().__init__()
        hid = c * t
        self.expand = nn.Conv2d(c, hid, 1)
        self.dw = nn.Conv2d(hid, hid, k, stride, k // 2, groups=hid)
        self.fc1, self.fc2 = (
            nn.Conv2d(hid, max(1, hid // 4), 1),
            nn.Conv2d(max(1, hid // 4), hid, 1),
        )
        self.pw = nn.Conv2d(hid, oc, 1)
        self.act, self.dw_act = act, dw_act or act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw_act(self.dw(self.act(self.expand(x))))
        s = F.hardsigmoid(self.fc2(F.relu(self.fc1(y.mean((2, 3), keepdim=True)))))
        return self.pw(y * s)


EXPAND_DW = opfuse.Options(implementation="opfuse-expand-dw")


def test_an_excited_block_runs_its_expansion_inside_the_depthwise_kernel() -> None:
    torch.manual_seed(9)
    m = _Excited(8, 3, 16).eval()
    fast, x = _checked(m, (2, 8, 15, 13), EXPAND_DW)
    groups = fast.report.groups
    (dw,) = [g for g in groups if DEPTHWISE in g.ops]
    assert dw.implementation.startswith("opfuse-expand-dw"), dw.implementation
    assert "expansion, then depthwise" in dw.source_code
    inside = [g for g in groups if g.kernel == f"(in group {dw.id})"]
    assert [g.ops[0] for g in inside] == ["aten.addmm.default"]
    # the tuner times it against the two groups apart
    tuned = opfuse.compile(m, (x,))
    assert_matches_eager(m, tuned(x), (x,))
    (g,) = [g for g in tuned.report.groups if DEPTHWISE in g.ops]
    if g.implementation.startswith("opfuse-expand-dw"):
        assert "separate " in g.implementation


# the last: no epilogue after the depthwise convolution (its rows straight to the output)
@pytest.mark.parametrize("acts", [(F.relu, F.relu), (F.silu, F.silu), (F.relu6, lambda t: t)])
def test_excited_blocks_of_every_activation(acts: Any) -> None:
    torch.manual_seed(10)
    m = _Excited(8, 3, 12, k=5, stride=2, act=acts[0], dw_act=acts[1]).eval()
    x = _nhwc(3, 8, 17, 11)
    fast = opfuse.compile(m, (x,), options=EXPAND_DW)
    assert_matches_eager(m, fast(x), (x,))
    (dw,) = [g for g in fast.report.groups if DEPTHWISE in g.ops]
    assert dw.implementation.startswith("opfuse-expand-dw"), dw.implementation


def test_a_block_whose_projection_reads_the_rows_takes_the_whole_block_kernel() -> None:
    """Where the projection can take the depthwise rows (no squeeze-and-excitation), the
    expansion is left to the three-group kernel: the depthwise group gets no candidate of
    its own that would absorb the expansion first."""
    torch.manual_seed(11)
    m = _Inverted(8, 3, 8).eval()
    x = _nhwc(1, 8, 9, 9)
    fast = opfuse.compile(m, (x,), options=EXPAND_DW)
    assert_matches_eager(m, fast(x), (x,))
    assert not any(g.implementation.startswith("opfuse-expand-dw ") for g in fast.report.groups)


def test_a_depthwise_epilogue_stores_the_outputs_of_the_expanded_kernel() -> None:
    """Expansion and depthwise convolution with its activation, the result returned and
    scaled: the depthwise epilogue writes both outputs from the band's tile."""

    class _Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.expand = nn.Conv2d(6, 20, 1)
            self.dw = nn.Conv2d(20, 20, 3, 1, 1, groups=20)

        def forward(self, x: torch.Tensor) -> Any:
            y = F.silu(self.dw(F.relu(self.expand(x))))
            return y, y * 2

    torch.manual_seed(12)
    m = _Head().eval()
    x = _nhwc(2, 6, 11, 9)
    fast = opfuse.compile(m, (x,), options=EXPAND_DW)
    assert_matches_eager(m, fast(x), (x,))
    (dw,) = [g for g in fast.report.groups if DEPTHWISE in g.ops]
    assert dw.implementation.startswith("opfuse-expand-dw"), dw.implementation
    assert "aten.silu.default" in dw.ops and "float *tile = dtile;" in dw.source_code
