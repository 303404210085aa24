"""BatchNorm folding: every conv/linear flavour against eager, the refusals with their
reasons, the caller's module untouched, training never folding, and a property test."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opfuse
from tests.conftest import assert_matches_eager

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def randomize(m: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial running statistics and affine parameters (fresh ones fold to identity)."""
    g = torch.Generator().manual_seed(seed)
    for mod in m.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
            mod.running_mean.copy_(torch.randn(mod.num_features, generator=g))
            mod.running_var.copy_(torch.rand(mod.num_features, generator=g) * 2 + 0.1)
            if mod.affine:
                mod.weight.data.copy_(torch.randn(mod.num_features, generator=g))
                mod.bias.data.copy_(torch.randn(mod.num_features, generator=g))
    return m.eval()


def x_for(dims: int, channels: int, batch: int = 2, size: int = 9) -> torch.Tensor:
    return torch.randn(batch, channels, *([size] * dims))


def check_folded(m: nn.Module, x: torch.Tensor, n_folds: int = 1) -> opfuse.FusionReport:
    state = copy.deepcopy(m.state_dict())
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    r = fast.report
    assert len(r.folds) == n_folds, str(r)
    ops = [op for g in r.groups for op in g.ops]
    assert not any("batch_norm" in op for op in ops), ops
    assert not any(op.startswith("aten.rsqrt") for op in ops), "BatchNorm left as an affine map"
    for k, v in m.state_dict().items():  # the caller's module is bit-identical
        assert torch.equal(v, state[k]), k
    return r


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_bn(dims: int, groups: int, bias: bool) -> None:
    m = randomize(
        nn.Sequential(CONV[dims](4, 8, 3, groups=groups, bias=bias, padding=1), BN[dims](8))
    )
    r = check_folded(m, x_for(dims, 4))
    assert r.folds[0].conv == "0" and r.folds[0].batchnorm == "1"


def test_depthwise_conv_bn_relu() -> None:
    m = randomize(
        nn.Sequential(nn.Conv2d(8, 8, 3, groups=8, stride=2), nn.BatchNorm2d(8), nn.ReLU())
    )
    check_folded(m, x_for(2, 8, size=12))


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_transpose_bn(dims: int, groups: int) -> None:
    # in=4, out=6 per group layout [in, out/groups, k..]: a wrong-axis fold is caught here
    m = randomize(nn.Sequential(CONVT[dims](4, 6, 3, groups=groups, stride=2), BN[dims](6)))
    check_folded(m, x_for(dims, 4, size=5))


def test_linear_bn1d() -> None:
    m = randomize(nn.Sequential(nn.Linear(10, 6), nn.BatchNorm1d(6), nn.GELU()))
    check_folded(m, torch.randn(5, 10))


def test_linear_without_bias_bn1d() -> None:
    m = randomize(nn.Sequential(nn.Linear(10, 6, bias=False), nn.BatchNorm1d(6)))
    check_folded(m, torch.randn(5, 10))


@pytest.mark.parametrize("eps,momentum", [(1e-5, 0.1), (1e-3, 0.9), (0.5, None)])
def test_affine_false_and_any_eps(eps: float, momentum: float | None) -> None:
    m = randomize(
        nn.Sequential(
            nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5, eps=eps, momentum=momentum, affine=False)
        )
    )
    check_folded(m, x_for(2, 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_weights(dtype: torch.dtype) -> None:
    m = randomize(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))).to(dtype)
    check_folded(m, x_for(2, 3).to(dtype))


def test_fold_in_float64_and_flush_subnormals() -> None:
    from opfuse.rewrite.batchnorm import fold_weights

    w = torch.full((2, 1, 1, 1), 1e-30)
    w[1] = 1.0
    gamma = torch.tensor([1e-10, 1.0])
    w2, _b2 = fold_weights(w, None, gamma, None, torch.zeros(2), torch.ones(2), 0.0)
    assert w2[0].item() == 0.0  # 1e-40 is subnormal in float32: flushed
    assert w2[1].item() == 1.0
    # float64 folding: (1 + 1e-8) would round away in float32 before the product
    w3, _ = fold_weights(
        torch.tensor([[3.0]]),
        None,
        torch.tensor([1.0]),
        None,
        torch.zeros(1),
        torch.tensor([1e-8]),
        1.0,
    )
    assert w3.item() == pytest.approx(3.0 / (1.0 + 1e-8) ** 0.5, rel=1e-7)


# -- refusals --------------------------------------------------------------------------------
def reasons(r: opfuse.FusionReport) -> list[str]:
    return [x.reason for x in r.rejected]


def test_no_running_stats_is_refused_with_reason() -> None:
    m = randomize(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU())
    )
    x = x_for(2, 3)
    fast = opfuse.compile(m, (x,))
    assert not fast.report.folds
    assert any("track_running_stats=False" in s for s in reasons(fast.report))
    assert_matches_eager(m, fast(x), (x,))


def test_conv_output_with_other_users_is_refused() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.bn(y) + y

    m = randomize(M())
    x = x_for(2, 3)
    fast = opfuse.compile(m, (x,))
    assert not fast.report.folds
    assert any("has 2 users" in s for s in reasons(fast.report)), reasons(fast.report)
    assert_matches_eager(m, fast(x), (x,))


def test_shared_conv_weight_is_never_changed() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(4)
            self.bn2 = nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn2(self.conv(self.bn1(self.conv(x))))  # one conv module called twice

    m = randomize(Shared())
    x = x_for(2, 4)
    fast = opfuse.compile(m, (x,))
    assert not fast.report.folds
    assert any("shared" in s for s in reasons(fast.report)), reasons(fast.report)
    assert_matches_eager(m, fast(x), (x,))


def test_training_mode_never_folds() -> None:
    torch.manual_seed(0)
    m1 = randomize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())).train()
    m2 = copy.deepcopy(m1)
    fast = opfuse.compile(m1, x_for(2, 3))
    for seed in range(3):
        x = x_for(2, 3, batch=4) + seed
        torch.testing.assert_close(fast(x), m2(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m1[1].running_mean, m2[1].running_mean)
    torch.testing.assert_close(m1[1].running_var, m2[1].running_var)
    r = opfuse.explain(m1, x_for(2, 3))
    assert not r.folds
    assert any("training mode" in s for s in reasons(r))


# -- the standalone API ---------------------------------------------------------------------------
def resnet_like() -> nn.Module:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)

    return randomize(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), Block(), Block())
    )


@pytest.mark.parametrize("with_inputs", [True, False])
def test_fold_batchnorm_returns_new_module(with_inputs: bool) -> None:
    m = resnet_like()
    state = copy.deepcopy(m.state_dict())
    x = x_for(2, 3, size=8)
    folded = opfuse.fold_batchnorm(m, x if with_inputs else None)
    assert folded is not m
    assert len(folded.batchnorm_folds) == 5
    assert not any(isinstance(mod, nn.BatchNorm2d) for mod in folded.modules())
    assert any(isinstance(mod, nn.BatchNorm2d) for mod in m.modules())
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), k
    with torch.no_grad():
        assert_matches_eager(m, folded(x), (x,))


def test_fold_batchnorm_training_mode_warns_and_folds_nothing() -> None:
    m = resnet_like().train()
    with pytest.warns(RuntimeWarning, match="training mode"):
        folded = opfuse.fold_batchnorm(m)
    assert folded.batchnorm_folds == []
    assert any(isinstance(mod, nn.BatchNorm2d) for mod in folded.modules())


# -- property test -------------------------------------------------------------------------------
@st.composite
def conv_bn(draw):  # type: ignore[no-untyped-def]
    dims = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2, 3]))
    cin = groups * draw(st.integers(1, 3))
    cout = groups * draw(st.integers(1, 3))
    transposed = draw(st.booleans())
    k = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 2))
    padding = draw(st.integers(0, k - 1))
    bias = draw(st.booleans())
    affine = draw(st.booleans())
    eps = draw(st.sampled_from([1e-5, 1e-3, 0.1]))
    seed = draw(st.integers(0, 1000))
    cls = CONVT[dims] if transposed else CONV[dims]
    conv = cls(cin, cout, k, stride=stride, padding=padding, groups=groups, bias=bias)
    m = randomize(nn.Sequential(conv, BN[dims](cout, eps=eps, affine=affine)), seed)
    size = draw(st.integers(k + 1, 7))
    return m, x_for(dims, cin, size=size)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_bn())
def test_random_conv_bn_folds_and_matches_eager(case) -> None:  # type: ignore[no-untyped-def]
    m, x = case
    check_folded(m, x)


def test_a_batchnorm_is_folded_once_for_every_shape() -> None:
    """opfuse.compile over several batch sizes folds each BatchNorm once (the folded weight
    is shared by the graphs of every shape), and again once its statistics change."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    m[1].running_mean.normal_()
    m[1].running_var.uniform_(0.5, 2)
    f = opfuse.compile(m, (torch.randn(2, 3, 10, 10),))
    with torch.no_grad():
        for b in (3, 5):
            x = torch.randn(b, 3, 10, 10)
            torch.testing.assert_close(f(x), m(x))

    def folded() -> set[int]:
        return {
            t.data_ptr()
            for e in f._entries.values()
            if e.compiled is not None
            for k, t in e.compiled.graph.constants.items()
            if k.endswith("weight_folded")
        }

    assert len(f._entries) == 3 and len(before := folded()) == 1
    with torch.no_grad():
        m[1].running_mean.add_(0.5)  # a new version: folded anew, not found by the old key
        x = torch.randn(4, 3, 10, 10)
        with pytest.warns(RuntimeWarning, match="modified in place"):
            got = f(x)
        torch.testing.assert_close(got, m(x))
    assert folded() and not folded() & before
