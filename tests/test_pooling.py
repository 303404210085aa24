"""Pooling as window reductions: max / average / evenly tiled adaptive pools become one
reduction kernel (pad and windows read through) that takes in the pointwise ops around it;
pools whose indices a backward reads, and adaptive pools with uneven windows, stay torch's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opfuse
from opfuse.frontend.dynamo import collect_reports
from tests.conftest import Fn, assert_matches_eager

CASES: dict[str, tuple[Any, tuple[int, ...]]] = {
    "max_pool1d": (lambda x: F.max_pool1d(x, 3, 2, 1), (4, 6, 31)),
    "max_pool2d 3x3/2 pad": (lambda x: F.max_pool2d(x, 3, 2, 1), (2, 8, 15, 17)),
    "max_pool2d ceil dilation": (
        lambda x: F.max_pool2d(x, 3, 2, 1, dilation=2, ceil_mode=True),
        (2, 8, 21, 20),
    ),
    "max_pool2d rectangular": (lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 0)), (2, 5, 9, 10)),
    "max_pool3d ceil": (lambda x: F.max_pool3d(x, 3, 2, 1, ceil_mode=True), (2, 4, 7, 8, 9)),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 3, 2, 1), (4, 6, 31)),
    "avg_pool2d exclude pad ceil": (
        lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
        (2, 8, 21, 21),
    ),
    "avg_pool2d include pad ceil": (
        lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
        (2, 8, 20, 20),
    ),
    "avg_pool2d divisor_override": (
        lambda x: F.avg_pool2d(x, 3, 1, 1, divisor_override=5),
        (2, 8, 12, 12),
    ),
    "avg_pool3d exclude pad": (
        lambda x: F.avg_pool3d(x, 3, 2, 1, count_include_pad=False),
        (2, 4, 7, 8, 9),
    ),
    "adaptive_avg_pool2d even": (lambda x: F.adaptive_avg_pool2d(x, (7, 5)), (2, 8, 14, 15)),
    "adaptive_max_pool2d even": (lambda x: F.adaptive_max_pool2d(x, 7), (2, 8, 14, 14)),
    "lp_pool2d": (lambda x: F.lp_pool2d(x, 2, 2), (2, 8, 14, 14)),
    "unbatched": (lambda x: F.max_pool2d(x, 2), (8, 14, 14)),
}


def _layout(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    if not channels_last or x.ndim < 4:
        return x
    return x.contiguous(
        memory_format=torch.channels_last if x.ndim == 4 else torch.channels_last_3d
    )


def _compile(f: Any, *args: torch.Tensor) -> tuple[nn.Module, opfuse.CompiledModule]:
    m = Fn(f).eval()
    fast = opfuse.compile(m, args)
    assert_matches_eager(m, fast(*args), args)
    return m, fast


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_pool_is_a_reduction_kernel_equal_to_eager(name: str, channels_last: bool) -> None:
    f, shape = CASES[name]
    x = _layout(torch.randn(shape, generator=torch.Generator().manual_seed(0)), channels_last)
    m, fast = _compile(f, x)
    out, ref = fast(x), m(x)
    assert out.stride() == ref.stride()  # channels-last in, channels-last out, as eager
    r = fast.report
    assert [g.pattern for g in r.groups if g.pattern != "elementwise"] == ["reduction"], str(r)
    assert len(r.pools) == 1 and "as a reduction kernel" in r.pools[0]
    assert "pool: " in str(r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_pools_sum_in_float32_and_round_once(dtype: torch.dtype) -> None:
    x = torch.randn(2, 8, 15, 15).to(dtype)
    _, fast = _compile(lambda t: F.avg_pool2d(t, 3, 2, 1, count_include_pad=False), x)
    src = fast._first.compiled.source
    assert "float acc0" in src or "float acc0_L" in src  # the window sums in float32
    _compile(lambda t: F.max_pool2d(t, 3, 2, 1), x)


def test_nan_in_a_window_propagates_like_eager() -> None:
    x = torch.randn(1, 3, 8, 8)
    x[0, 1, 2, 3] = float("nan")
    x[0, 2, 0, 0] = float("-inf")
    for cl in (False, True):
        m, fast = _compile(lambda t: F.max_pool2d(t, 3, 2, 1), _layout(x, cl))
        assert torch.isnan(fast(_layout(x, cl))).sum() == torch.isnan(m(_layout(x, cl))).sum() > 0


def test_pointwise_ops_around_a_pool_run_in_its_kernel() -> None:
    x = torch.randn(2, 8, 16, 16)
    for cl in (False, True):
        _, fast = _compile(lambda t: F.max_pool2d(torch.relu(t) * 2, 3, 2, 1) + 1, _layout(x, cl))
        assert fast.report.kernels_after == 1
        # PoolFormer's token mixer: pool(x) - x
        _, fast = _compile(
            lambda t: F.avg_pool2d(t, 3, 1, 1, count_include_pad=False) - t, _layout(x, cl)
        )
        assert fast.report.kernels_after == 1, str(fast.report)


@pytest.mark.parametrize(
    "act",
    [torch.relu, lambda t: F.hardtanh(t, -1.0, 2.0), lambda t: t.clamp(min=0.5)],
    ids=["relu", "hardtanh", "clamp"],
)
def test_a_monotone_op_before_a_max_pool_runs_after_it(act: Any) -> None:
    """max(f(x)) = f(max(x)) for a non-decreasing f where every window holds an element
    of x: f runs once per output. NaN and infinities land where eager puts them."""
    x = torch.randn(2, 8, 15, 17)
    x[0, 1, 2, 3], x[1, 2, 0, 0], x[1, 3, 5, 5] = float("nan"), float("-inf"), float("inf")
    x[1, 4] = float("-inf")  # a whole channel of -inf: f(-inf) in every window
    for cl in (False, True):
        m, fast = _compile(lambda t: F.max_pool2d(act(t), 3, 2, 1), _layout(x, cl))
        (note,) = fast.report.pools
        assert "applied after" in note, note
        assert fast.report.kernels_after == 1
        out = fast(_layout(x, cl))
        assert torch.equal(torch.isnan(out), torch.isnan(m(_layout(x, cl))))


def test_an_op_before_a_max_pool_stays_before_it_where_it_must() -> None:
    x = torch.randn(2, 8, 15, 17)
    cases = [
        lambda t: F.max_pool2d(torch.relu(t), 3, 2, 1, dilation=2),  # windows may miss x
        lambda t: (lambda r: F.max_pool2d(r, 3, 2, 1) + r.mean())(torch.relu(t)),  # read twice
        lambda t: F.max_pool2d(torch.sigmoid(t) * t, 3, 2, 1),  # not monotone
    ]
    for f in cases:
        _, fast = _compile(f, x)
        assert not any("applied after" in n for n in fast.report.pools), fast.report.pools


def test_channels_last_pools_take_lanes_along_the_channels() -> None:
    x = _layout(torch.randn(2, 32, 16, 16), True)
    _, fast = _compile(lambda t: F.max_pool2d(t, 3, 2, 1), x)
    [g] = fast.report.groups
    assert "schedule columns" in g.source_code
    # NCHW: lanes along the output row, reading with the pool's stride
    _, fast = _compile(lambda t: F.max_pool2d(t, 3, 2, 1), torch.randn(2, 32, 16, 16))
    assert "schedule columns" in fast.report.groups[0].source_code


def test_a_large_max_window_runs_one_pass_per_dimension() -> None:
    # SPP (YOLO): 5, 9 and 13 wide stride-1 pools next to the input, concatenated
    x = torch.randn(1, 16, 20, 20)

    def spp(t: torch.Tensor) -> torch.Tensor:
        pools = [F.max_pool2d(t, k, 1, k // 2) for k in (5, 9, 13)]
        return torch.cat([t, *pools], 1)

    for cl in (False, True):
        _, fast = _compile(spp, _layout(x, cl))
        reductions = [g for g in fast.report.groups if g.pattern == "reduction"]
        assert len(reductions) == 1 + 2 + 2  # 5x5 in one pass, 9x9 and 13x13 in two


def test_a_global_max_pool_is_one_reduction() -> None:
    # non-overlapping windows read every element once: no pass per dimension
    x = torch.randn(2, 8, 14, 15)
    for cl in (False, True):
        _, fast = _compile(lambda t: F.adaptive_max_pool2d(t, 1).flatten(1), _layout(x, cl))
        assert [g.pattern for g in fast.report.groups] == ["reduction"], str(fast.report)


def test_pools_torch_must_compute_stay_torch_calls() -> None:
    x = torch.randn(2, 8, 14, 14)
    for f in (
        lambda t: F.max_pool2d(t, 2, return_indices=True),  # the indices are an output
        lambda t: F.adaptive_avg_pool2d(t, 5),  # uneven windows
        lambda t: F.adaptive_max_pool2d(t, 5),
    ):
        _, fast = _compile(f, x)
        assert [g.pattern for g in fast.report.groups] == ["fallback"]
        assert fast.report.pools == []


def test_training_keeps_max_pooling_indices_for_the_backward() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 3),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.LazyLinear(4),
    )
    x = torch.randn(2, 3, 16, 16)
    net(x)
    ref = [p.detach().clone() for p in net.parameters()]
    net(x).square().sum().backward()
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    report = collect_reports(net, (x,), {}, backward=True)
    net.zero_grad()
    torch._dynamo.reset()
    torch.compile(net, backend="opfuse")(x).square().sum().backward()
    for p, w, r in zip(net.parameters(), want, ref, strict=True):
        assert torch.equal(p.detach(), r)
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-5)
    ops = [o for g in report.groups for o in g.ops]
    assert "aten.max_pool2d_with_indices.default" in ops  # its indices feed the backward
    assert any("avg_pool2d" in p for p in report.pools)


def test_resnet_stem_in_inference_pools_in_a_kernel() -> None:
    net = nn.Sequential(
        nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
    ).eval()
    x = torch.randn(2, 3, 64, 64)
    fast = opfuse.compile(net, (x,))
    assert_matches_eager(net, fast(x), (x,))
    # the ReLU runs where the pool reads the convolution's output (an epilogue of the
    # reduction instead of the convolution: the same traffic)
    *_, pool = fast.report.groups
    assert fast.report.kernels_after == 2 and pool.pattern == "reduction", str(fast.report)
    assert "amax" in pool.kernel


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["max", "avg"]),
    k=st.integers(1, 4),
    s=st.integers(1, 3),
    p=st.integers(0, 2),
    d=st.integers(1, 2),
    ceil=st.booleans(),
    include_pad=st.booleans(),
    size=st.tuples(st.integers(5, 12), st.integers(5, 12)),
    channels_last=st.booleans(),
)
def test_random_pools_match_eager(
    kind: str,
    k: int,
    s: int,
    p: int,
    d: int,
    ceil: bool,
    include_pad: bool,
    size: tuple[int, int],
    channels_last: bool,
) -> None:
    p = min(p, k // 2)  # torch: padding at most half the window
    if kind == "max":

        def f(t: torch.Tensor) -> torch.Tensor:
            return F.max_pool2d(t, k, s, p, dilation=d, ceil_mode=ceil)

    else:

        def f(t: torch.Tensor) -> torch.Tensor:
            return F.avg_pool2d(t, k, s, p, ceil_mode=ceil, count_include_pad=include_pad)

    x = _layout(torch.randn(2, 3, *size), channels_last)
    try:
        f(x)
    except RuntimeError:
        return  # an output size torch rejects
    m, fast = _compile(f, x)
    assert fast(x).stride() == m(x).stride()


@pytest.mark.parametrize(
    "f, x",
    [
        (  # ViT-style patchify: one copy kernel reading through the windows
            lambda t: (
                t.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(2, 16, -1)
            ),
            torch.randn(2, 3, 16, 16),
        ),
        (lambda t: t.unfold(-1, 5, 1).mean(-1) - t[..., 2:-2], torch.randn(4, 50)),  # sliding
        (lambda t: (t.unfold(-1, 16, 8) * torch.hann_window(16)).sum(-1), torch.randn(3, 128)),
        (lambda t: t.unfold(0, 1, 1) + 1, torch.tensor(3.0)),  # 0-d: its one element
    ],
)
def test_unfold_is_a_view_kernels_read_through(f: Any, x: torch.Tensor) -> None:
    _, fast = _compile(f, x)
    assert fast.report.kernels_after == 1
    assert all(g.pattern in ("elementwise", "reduction") for g in fast.report.groups)
