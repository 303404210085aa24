"""Reduction fusion: the prologue and epilogue of a reduction run inside it, one kernel per
case, on rows, columns, middle and several dims, full reductions, every schedule."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opfuse
from opfuse.frontend.dynamo import collect_reports
from tests.conftest import Fn, assert_matches_eager, assert_no_worse


def one_kernel(fn: Any, *args: Any) -> opfuse.FusionReport:
    m = fn.eval() if isinstance(fn, nn.Module) else Fn(fn).eval()
    fast = opfuse.compile(m, args)
    assert_matches_eager(m, fast(*args), args)
    r = fast.report
    assert r.kernels_after == 1, str(r)
    assert r.groups[0].pattern == "reduction", str(r)
    return r


def source(fn: Any, *args: Any) -> str:
    fast = opfuse.compile(Fn(fn).eval(), args)
    return fast._first.compiled.source  # type: ignore[no-any-return]


X = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
X4 = torch.randn(4, 8, 6, 10, generator=torch.Generator().manual_seed(1))

CASES = {
    "sum(relu(x))": (lambda a: a.relu().sum(), X),
    "mean(x*x)": (lambda a: (a * a).mean(), X),
    "x.pow(2).mean(-1)": (lambda a: a.pow(2).mean(-1), X),
    "amax(abs(x))": (lambda a: a.abs().amax(-1), X),
    "prod": (lambda a: (a * 0.1 + 1).prod(-1), X),
    "argmax": (lambda a: a.argmax(-1), X),
    "argmin columns": (lambda a: a.argmin(0), X),
    "argmax flat": (lambda a: a.argmax(), X),
    "norm": (lambda a: a.norm(dim=-1), X),
    "vector_norm full": (lambda a: torch.linalg.vector_norm(a, ord=3), X),
    "var": (lambda a: a.var(-1), X),
    "std columns": (lambda a: a.std(0), X),
    "var_mean dims (0, 2)": (lambda a: torch.var_mean(a, (0, 2), correction=0), X4),
    "logsumexp": (lambda a: a.logsumexp(-1), X),
    "logsumexp keepdim middle": (lambda a: a.logsumexp(1, keepdim=True), X4),
    "max dim values+indices": (lambda a: a.max(-1), X),
    "min dim keepdim": (lambda a: a.min(1, keepdim=True), X4),
    "any": (lambda a: (a > 2).any(-1), X),
    "all full": (lambda a: (a > -4).all(), X),
    "int sum": (lambda a: a.sum(-1), torch.randint(-5, 5, (10, 20))),
    "sum with dtype": (lambda a: a.sum(-1, dtype=torch.float64), X),
    "sum middle dim": (lambda a: a.sum(1), X4),
    "amax two dims": (lambda a: a.amax((1, 3)), X4),
    "mean keepdim epilogue": (lambda a: a - a.mean(-1, keepdim=True), X),
    "mean then unsqueeze epilogue": (lambda a: a - a.mean(-1).unsqueeze(-1), X),
    "columns epilogue": (lambda a: a / a.sum(0), X),
    "layer_norm": (nn.LayerNorm(96), X),
    "softmax": (lambda a: a.softmax(-1), X),
    "softmax columns": (lambda a: a.softmax(0), X),
    "log_softmax": (lambda a: a.log_softmax(-1), X),
    "batch_norm train stats": (lambda a: torch.var_mean(a, (0, 2, 3), correction=0), X4),
    "instance_norm": (lambda a: F.instance_norm(a), X4),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reduction_is_one_kernel(name: str) -> None:
    fn, *args = CASES[name]
    one_kernel(fn, *args)


def test_layer_norm_with_residual_and_residual_output() -> None:
    def pre_norm(x, r, w, b):  # type: ignore[no-untyped-def]
        h = x + r  # pre-norm blocks keep the residual stream
        return F.layer_norm(h, (96,), w, b), h

    rep = one_kernel(pre_norm, X, X.flip(0), torch.randn(96), torch.randn(96))
    assert rep.groups[0].ops[0] == "aten.add.Tensor"
    assert "aten.var_mean.correction" in rep.groups[0].ops


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rms_norm_with_upcast(dtype: torch.dtype) -> None:
    def rms(x, w):  # type: ignore[no-untyped-def]
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    one_kernel(rms, X.to(dtype), torch.randn(96).to(dtype))


def test_attention_softmax_with_scale_mask_and_bias() -> None:
    s = torch.randn(2, 3, 16, 16)
    mask = torch.rand(16, 16) > 0.7
    bias = torch.randn(3, 16, 16)
    one_kernel(
        lambda a, m, b: ((a * 0.125 + b).masked_fill(m, float("-inf"))).softmax(-1), s, mask, bias
    )
    one_kernel(lambda a, b: (a / 8 + b).log_softmax(-1), s, bias)


def test_batch_norm_training_in_one_pass() -> None:
    def bn_train(x, w, b):  # type: ignore[no-untyped-def]
        return F.batch_norm(x, None, None, w, b, training=True)

    rep = one_kernel(bn_train, X4, torch.randn(8), torch.randn(8))
    assert rep.groups[0].ops.count("aten.var_mean.correction") == 1


def test_variance_is_stable_for_large_means() -> None:
    x = torch.randn(128, 4096, dtype=torch.float64).mul(1.0).add(1e4).float()
    m = Fn(lambda a: (a.var(-1), F.layer_norm(a, (4096,)))).eval()
    fast = opfuse.compile(m, (x,))
    var, ln = fast(x)
    x64 = x.double()
    torch.testing.assert_close(var.double(), x64.var(-1), rtol=1e-4, atol=0)
    ref = F.layer_norm(x64, (4096,))
    assert (ln.double() - ref).abs().max() < 1e-3  # E[x^2]-E[x]^2 would lose everything here
    assert_matches_eager(m, (var, ln), (x,))


@pytest.mark.parametrize("n", [100, 512, 4096, 1 << 20, (1 << 20) + 37])
def test_float_sums_fold_float32_runs_into_float64(n: int) -> None:
    # Runs of 512 float32 values, then float64: float32's vector speed, float64's accuracy.
    x = torch.randn(3, n, dtype=torch.float64).mul(0.1).add(1e3).float()
    fn = lambda a: (a * a).sum(-1)
    src = source(fn, x)
    assert "float acc0_run" in src and "double acc0_value" in src
    out = opfuse.compile(Fn(fn).eval(), (x,))(x)
    exact = (x.double() * x.double()).sum(-1)
    assert ((out.double() - exact).abs() / exact).max() < 1e-6  # float32 eps is 1.2e-7
    assert_no_worse(out, fn(x), exact)


def test_sums_that_can_cancel_accumulate_in_float64_one_by_one() -> None:
    # Terms of one sign run in float32 blocks; terms of either sign go to float64 directly.
    x = torch.randn(16, 3000)
    assert "float acc0_run" in source(lambda a: a.relu().sum(-1), x)
    assert "float acc0_run" in source(lambda a: a.exp().sum(-1), x)
    src = source(lambda a: a.sum(-1), x)
    assert "float acc0_run" not in src and "double acc0_value" in src
    # A row of large terms that cancel to a small sum: eager's float32 cascade errs; ours is
    # as close as float64 accumulation gets.
    big = torch.randn(4, 3000, dtype=torch.float64) * 1e4
    big = torch.cat([big, -big + torch.rand(4, 3000, dtype=torch.float64)], 1).float()
    exact = big.double().sum(-1)
    out = opfuse.compile(Fn(lambda a: a.sum(-1)).eval(), (big,))(big)
    assert_no_worse(out, big.sum(-1), exact)
    assert (out.double() - exact).abs().max() <= 1e-6 * exact.abs().max()


def test_normalisation_gradients_are_no_further_from_float64_than_eager() -> None:
    # InstanceNorm's backward subtracts a row's mean gradient from every element and the
    # conv bias gradient sums the row again: a float32 error in the mean is multiplied by the
    # row's length. Eager's batch-norm kernels sum in double; so must ours.
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3, padding=1)

    def f(c: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.instance_norm(F.hardswish(c(x)))

    x = torch.randn(2, 8, 16, 16)
    grads = []
    for mode in ("eager", "opfuse", "float64"):
        c = copy.deepcopy(conv).double() if mode == "float64" else copy.deepcopy(conv)
        xi = x.double() if mode == "float64" else x
        run = torch.compile(f, backend="opfuse") if mode == "opfuse" else f
        torch._dynamo.reset()
        out = run(c, xi)
        weight = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).view(out.shape)
        (out * weight).sum().backward()
        assert c.bias.grad is not None
        grads.append(c.bias.grad)
    assert_no_worse(grads[1], grads[0], grads[2], "bias grad")


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: F.layer_norm(a, (a.shape[-1],)),
        lambda a: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6),
        lambda a: F.instance_norm(a.view(4, 16, 8, 12)).view(64, 96),
    ],
)
def test_per_row_statistics_continue_in_float64(fn: Any) -> None:
    # var + eps and its rsqrt run once per row in the float64 the sums were made in (as
    # eager's CPU kernels do) and round once; per-element arithmetic stays float32.
    x = X * 3 + 1
    src = source(fn, x)
    assert re.search(r"const double t\d+ = \(1 / sqrt\(", src), src
    assert "sqrtf" not in src
    out = opfuse.compile(Fn(fn).eval(), (x,))(x)
    assert_no_worse(out, fn(x), fn(x.double()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_sums_accumulate_in_float(dtype: torch.dtype) -> None:
    x = (torch.rand(8, 8192) + 1).to(dtype)
    m = Fn(lambda a: a.sum(-1)).eval()
    out = opfuse.compile(m, (x,))(x)
    exact = x.double().sum(-1)
    assert ((out.double() - exact).abs() / exact).max() < 1e-2


def _widened_with_column_sums(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = a.unsqueeze(1).expand(a.shape[0], 8, a.shape[1]).reshape(a.shape[0], 8 * a.shape[1]) * 2
    return y, y.sum(0)


def _bn_channels_last(a: torch.Tensor) -> torch.Tensor:
    v, m = torch.var_mean(a, (0, 2, 3), keepdim=True, correction=0)
    return ((a - m) * torch.rsqrt(v + 1e-5)).relu().contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "fn,shape,schedule",
    [
        (lambda a: a.relu().sum(), (1 << 23,), "split"),
        (lambda a: a.softmax(-1), (2, 1 << 20), "split"),
        (lambda a: torch.var_mean(a, -1), (3, 1 << 19), "split"),
        (lambda a: a.argmax(), (1 << 21,), "split"),
        (lambda a: a.sum(0), (64, 40000), "columns"),
        (lambda a: a.softmax(-1), (512, 512), "rows"),
        # too few column blocks for the threads: they split the rows and merge lanes
        (lambda a: a.sum(0), (4096, 64), "columns_split"),
        (lambda a: a / a.sum(0), (4099, 70), "columns_split"),
        (lambda a: a.softmax(0), (3001, 600), "columns_split"),
        (lambda a: a.argmax(0), (20000, 5), "columns_split"),
        (lambda a: a.amin(0), (20000, 5), "columns_split"),
        (lambda a: torch.var_mean(a + 1e4, 0), (9000, 33), "columns_split"),
        (lambda a: (a > 0).any(0), (20000, 7), "columns_split"),
        # the output it writes is the biggest stream, not its input (a QKV bias gradient
        # summed over the gradient it writes out): lanes along the output's rows
        (_widened_with_column_sums, (4096, 64), "columns_split"),
        # normalised NCHW rows stored channels-last: a line holds every channel, so the
        # threads split the rows instead of the channels (long rows only)
        (lambda a: _bn_channels_last(a), (8, 16, 64, 64), "split"),
        (lambda a: _bn_channels_last(a), (8, 256, 14, 14), "rows"),
    ],
)
def test_schedules(fn, shape, schedule) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    src = source(fn, x)
    assert re.findall(r"schedule (\w+)", src) == [schedule]
    m = Fn(fn).eval()
    assert_matches_eager(m, opfuse.compile(m, (x,))(x), (x,))


def test_channels_last_statistics_use_columns() -> None:
    x = X4.to(memory_format=torch.channels_last)
    fn = lambda a: torch.var_mean(a, (0, 2, 3), correction=0)
    assert "schedule columns" in source(fn, x)
    one_kernel(fn, x)


@pytest.mark.parametrize("layout", ["mixed", "same"])
@pytest.mark.parametrize("reduce", [True, False])
def test_gathered_operands_are_staged_for_the_vector_loop(layout: str, reduce: bool) -> None:
    # channels-last `a` puts the vector lanes on channels, so NCHW `b` would be gathered,
    # 4 KiB apart per lane for a 32x32 plane (from one L1 set: measured 100x slower at
    # 8x32x64x64); it is copied into a contiguous array for each chunk of lanes first.
    a = torch.randn(2, 16, 32, 32).to(memory_format=torch.channels_last)
    b = torch.randn(2, 16, 32, 32)
    if layout == "same":
        b = b.to(memory_format=torch.channels_last)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = a * torch.sigmoid(b) * b
        return y.sum((2, 3)) if reduce else y

    src = source(fn, a, b)
    assert ("_s0[" in src) == (layout == "mixed")
    m = Fn(fn).eval()
    assert_matches_eager(m, opfuse.compile(m, (a, b))(a, b), (a, b))


@pytest.mark.parametrize("channels", [256, 300, 5000])
def test_a_row_read_transposed_is_staged_once_for_every_pass(channels: int) -> None:
    # MLP-Mixer's token mixing: LayerNorm(x + t.transpose(1, 2)) reads `t` 64 elements
    # apart along the row. Rows up to ROW_STAGE are copied once, before the statistics and
    # the normalising passes (before: the statistics loops gathered, 0.54 -> 0.20 ms).
    x = torch.randn(4, 64, channels) * 3 + 50
    t = torch.randn(4, channels, 64)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(a + b.transpose(1, 2), (channels,))

    src = source(fn, x, t)
    staged_once = channels <= 4096
    assert ("r0_row_s0[" in src) == staged_once
    assert src.count("= in1[") == (1 if staged_once else 3)  # one read of `t` per pass
    m = Fn(fn).eval()
    assert_matches_eager(m, opfuse.compile(m, (x, t))(x, t), (x, t))


@pytest.mark.parametrize("shape", [(1, 32, 128, 128), (1, 40, 96, 97)])
def test_welford_rows_with_a_short_contiguous_loop_fold_it(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's GroupNorm decomposition reduces [N, G, C/G*H*W] rows; over a channels-last
    # image the 4 (5) channels of a row are the contiguous loop, too short for the Welford
    # lanes: they run over pixels x channels flattened (before: every element in the
    # scalar tail, 8x128x32x32 4.0 ms -> 1.5 ms). Rows short enough for the two-pass
    # variance do not fold yet. (Capture now brings its own GroupNorm; torch's is put back
    # here to keep such rows.)
    from torch._decomp import get_decompositions

    from opfuse.frontend.decompose import decompositions

    op = torch.ops.aten.native_group_norm
    for listed in (True, False):  # (capture's retrace takes the unlisted one)
        monkeypatch.setitem(
            decompositions(listed), op.default, get_decompositions([op])[op.default]
        )
    x = (torch.randn(shape) * 3 + 100).to(memory_format=torch.channels_last)

    def fn(a: torch.Tensor) -> torch.Tensor:
        return F.silu(F.group_norm(a, 8))

    assert re.search(r"_q\d+ \+ 64 <=", source(fn, x))
    m = Fn(fn).eval()
    assert_matches_eager(m, opfuse.compile(m, (x,))(x), (x,))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(
    ("shape", "groups", "affine"),
    [((4, 8, 6, 10), 4, True), ((4, 8, 6, 10), 2, False), ((2, 40, 24, 25), 8, True)],
)
def test_group_norm_takes_statistics_per_channel(
    shape: tuple[int, ...], groups: int, affine: bool, channels_last: bool
) -> None:
    # A group's elements lie C apart in a channels-last image: reduced as one row they were
    # gathered one by one (GroupNorm + SiLU 0.26x eager). Per-channel statistics reduce the
    # spatial dims in either layout (columns in NHWC), then combine per group.
    x = (torch.randn(shape) * 3 + 100).contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format
    )
    m = nn.Sequential(nn.GroupNorm(groups, shape[1], affine=affine), nn.SiLU()).eval()
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    r = fast.report
    assert [g.pattern for g in r.groups] == ["reduction", "reduction", "elementwise"]
    assert r.groups[0].ops == ["aten.var_mean.correction"]
    src = fast._first.compiled.source
    first = src.split("schedule ")[1].split(";")[0]
    assert first.startswith("columns") == channels_last


@pytest.mark.parametrize("channels_last", [False, True])
def test_group_norm_of_one_channel_per_group_is_one_kernel(channels_last: bool) -> None:
    x = torch.randn(2, 6, 5, 7).contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format
    )
    one_kernel(nn.Sequential(nn.GroupNorm(6, 6), nn.GELU()), x)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_batchnorm_statistics_channels_last_split_across_threads(threads: int) -> None:
    # 64 channels are one block of lanes: the threads share the 25088 rows, merge their
    # Welford lanes, then each normalises its own rows. Mean 1e4: no cancellation.
    x = (torch.randn(8, 64, 56, 56) + 1e4).contiguous(memory_format=torch.channels_last)

    def bn(a: torch.Tensor) -> Any:
        v, m = torch.var_mean(a, (0, 2, 3), keepdim=True, correction=0)
        return (a - m) * torch.rsqrt(v + 1e-5), m, v

    assert "schedule columns_split" in source(bn, x)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one_kernel(bn, x)
    finally:
        torch.set_num_threads(before)


def test_nan_and_inf_semantics() -> None:
    x = torch.tensor(
        [
            [1.0, float("nan"), 3.0, float("nan")],
            [2.0, 2.0, 1.0, 2.0],
            [float("-inf")] * 4,
            [0.0, -0.0, 0.0, 1.0],
        ]
    )
    for fn in (
        lambda a: a.amax(-1),
        lambda a: a.argmax(-1),
        lambda a: a.max(-1),
        lambda a: a.argmin(-1),
        lambda a: a.sum(-1),
        lambda a: a.softmax(-1),
    ):
        m = Fn(fn).eval()
        assert_matches_eager(m, opfuse.compile(m, (x,))(x), (x,))


def test_reduced_value_feeding_a_matmul_is_explained() -> None:
    m = Fn(lambda x, w: x.softmax(-1) @ w).eval()
    r = opfuse.explain(m, (X, torch.randn(96, 5)))
    assert any("reduced value feeds a matmul" in x.reason for x in r.rejected)


def test_different_reduction_axes_do_not_fuse_and_say_why() -> None:
    m = Fn(lambda x: x - x.mean(0) - x.mean(1, keepdim=True)).eval()
    fast = opfuse.compile(m, (X,))
    assert_matches_eager(m, fast(X), (X,))
    assert any("reduces dims" in x.reason for x in fast.report.rejected)


# -- backward graphs ---------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["layer_norm", "softmax", "log_softmax", "rms_norm"])
def test_backward_graphs_fuse_and_match_eager(module: str) -> None:
    torch.manual_seed(0)
    mods = {
        "layer_norm": nn.LayerNorm(96),
        "softmax": nn.Softmax(-1),
        "log_softmax": nn.LogSoftmax(-1),
        "rms_norm": nn.RMSNorm(96),
    }
    m = nn.Sequential(nn.Linear(96, 96), mods[module])
    m64 = copy.deepcopy(m).double()
    grads = []
    for model, compiled, dtype in (
        (m, False, torch.float32),
        (m64, False, torch.float64),
        (copy.deepcopy(m), True, torch.float32),
    ):
        x = X.to(dtype).clone().requires_grad_()
        out = (torch.compile(model, backend="opfuse") if compiled else model)(x)
        (out * out).sum().backward()
        grads.append([out.detach(), x.grad] + [p.grad for p in model.parameters()])
    eager, ref64, ours = grads
    for o, e, r in zip(ours, eager, ref64):
        assert_no_worse(o, e, r, "backward", factor=2.0)
    rep = collect_reports(m, (X.clone().requires_grad_(),), {}, backward=True)
    # every row reduction of the backward (the sums over the normalised dim) is fused with
    # its pointwise neighbours: no pointwise op is left alone between two reductions
    assert rep.patterns().get("reduction", 0) >= 2
    assert rep.patterns().get("elementwise", 0) <= 1


# -- property test ------------------------------------------------------------------------------
REDUCE = {
    "sum": lambda t, d, k: t.sum(d, keepdim=k),
    "mean": lambda t, d, k: t.mean(d, keepdim=k),
    "amax": lambda t, d, k: t.amax(d, keepdim=k),
    "amin": lambda t, d, k: t.amin(d, keepdim=k),
    "var": lambda t, d, k: t.var(d, keepdim=k),
    "logsumexp": lambda t, d, k: t.logsumexp(d, keepdim=k),
}
PRO = [
    torch.relu,
    torch.tanh,
    lambda t: t * 1.5 + 0.25,
    torch.sigmoid,
    torch.abs,
    lambda t: t * t,
    F.gelu,
]
EPI = [torch.exp, lambda t: t * 0.5, torch.sqrt, lambda t: t + 1.0, torch.neg]


@st.composite
def reduction_cases(draw: Any) -> tuple[Any, torch.Tensor]:
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))
    dims = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank)))
    keep = draw(st.booleans())
    red = draw(st.sampled_from(sorted(REDUCE)))
    pro = draw(st.lists(st.integers(0, len(PRO) - 1), max_size=3))
    epi = draw(st.lists(st.integers(0, len(EPI) - 1), max_size=2))
    back = draw(st.booleans())  # epilogue combining the reduced value with the input
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    layout = draw(st.sampled_from(["contiguous", "transposed"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 9999)))
    x = torch.randn(shape, generator=g).to(dtype)
    if layout == "transposed" and rank >= 2:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)

    def fn(t: torch.Tensor) -> torch.Tensor:
        for i in pro:
            t = PRO[i](t)
        r = REDUCE[red](t, dims, keep)
        for i in epi:
            r = EPI[i](r.abs() if EPI[i] is torch.sqrt else r)
        if back and keep:
            return t - r  # broadcast back over the input: a full-size epilogue
        return r

    return fn, x


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reduction_cases())
def test_random_prologue_reduction_epilogue(case: Any) -> None:
    fn, x = case
    m = Fn(fn).eval()
    fast = opfuse.compile(m, (x,))
    assert fast.report.kernels_after == 1, str(fast.report)
    assert_matches_eager(m, fast(x), (x,))


NORMALISE = {
    "softmax": lambda t, d: t.softmax(d[0]),
    "log_softmax": lambda t, d: t.log_softmax(d[0]),
    "standardise": lambda t, d: (
        (t - t.mean(d, keepdim=True)) * torch.rsqrt(t.var(d, keepdim=True, correction=0) + 1e-5)
    ),
    "rms": lambda t, d: t * torch.rsqrt(t.pow(2).mean(d, keepdim=True) + 1e-6),
    "max_scaled": lambda t, d: t.exp() / t.exp().sum(d, keepdim=True) * t.amax(d, keepdim=True),
}


@st.composite
def normalisation_cases(draw: Any) -> tuple[Any, torch.Tensor]:
    """Multi-pass kernels (statistics, then a pass that writes and may re-read the output)
    over any dims of an input in any memory layout: a channels-last softmax over channels
    once re-read its own output before writing it."""
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))
    dims = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank)))
    op = draw(st.sampled_from(sorted(NORMALISE)))
    perm = draw(st.permutations(range(rank)))
    pro = draw(st.lists(st.integers(0, len(PRO) - 1), max_size=2))
    scale = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 9999)))
    # stored in `perm` order, seen in the logical order: channels-last and the like
    stored = torch.randn([shape[p] for p in perm], generator=g)
    x = stored.permute([perm.index(i) for i in range(rank)])

    def fn(t: torch.Tensor) -> torch.Tensor:
        for i in pro:
            t = PRO[i](t)
        r = NORMALISE[op](t, dims)
        return r * 2.0 + 0.5 if scale else r

    return fn, x


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(normalisation_cases())
def test_random_normalisation_over_any_layout(case: Any) -> None:
    fn, x = case
    m = Fn(fn).eval()
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    assert_matches_eager(m, fast(x), (x,))


def test_softmax_over_channels_of_channels_last_input() -> None:
    # The row staging copied softmax's output before the pass that stores exp() into it.
    x = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    m = Fn(lambda t: t.softmax(1) * 2).eval()
    fast = opfuse.compile(m, (x,))
    assert fast.report.kernels_after == 1
    assert_matches_eager(m, fast(x), (x,))
