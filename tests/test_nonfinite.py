"""NaN and inf flow through every epilogue implementation as they do in eager. oneDNN
computes relu, clamp and hardsigmoid post-ops with max/min, which turn NaN into a bound:
those run fused only behind a finiteness guard (opfuse/runtime/finite.py)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opfuse
from opfuse.runtime.execute import KernelStep
from opfuse.runtime.finite import FiniteGuard, max_abs
from tests.conftest import assert_matches_eager

ACTIVATIONS = {
    "relu": torch.relu,
    "relu6": F.relu6,
    "clamp": lambda t: t.clamp(-0.5, 0.5),
    "clamp_min": lambda t: t.clamp(min=0.25),
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "leaky_relu": lambda t: F.leaky_relu(t, 0.2),
    "gelu": F.gelu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
CONV_IMPLS = [None, "unfused", "onednn", "onednn-nhwc"]
LINEAR_IMPLS = [None, "unfused", "blocked", "onednn", "mkl-unfused", "onednn-unfused"]


@contextlib.contextmanager
def matmul_precision(p: str) -> Iterator[None]:
    """float32 oneDNN GEMMs are candidates only below "highest" precision."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(p)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def poisoned(shape: tuple[int, ...], seed: int, kinds: str = "nan+inf") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.view(-1)
    picks = torch.randperm(flat.numel(), generator=g)[:3]
    values = {"nan": [math.nan] * 3, "inf": [math.inf, -math.inf, math.inf]}.get(
        kinds, [math.nan, math.inf, -math.inf]
    )
    for p, v in zip(picks.tolist(), values):
        flat[p] = v
    return x


class Layer(nn.Module):
    """act(layer(x) [+ residual])"""

    def __init__(self, layer: nn.Module, act: str) -> None:
        super().__init__()
        self.layer, self.act = layer, act

    def forward(self, x: torch.Tensor, *residual: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        return ACTIVATIONS[self.act](y + residual[0] if residual else y)


def measuring(monkeypatch: Any) -> list[tuple[int, ...]]:
    """The shapes of the values the guards measure from now on, in order."""
    measured: list[tuple[int, ...]] = []

    def counting(t: torch.Tensor) -> float:
        measured.append(tuple(t.shape))
        return max_abs(t)

    monkeypatch.setattr("opfuse.runtime.finite.max_abs", counting)
    return measured


def guards(fast: Any) -> list[FiniteGuard]:
    plans = [e.compiled.run.plan for e in fast._entries.values() if e.compiled is not None]
    return [s.guard for p in plans for s in p.steps if getattr(s, "guard", None) is not None]


def test_conv_relu_with_one_nan_pixel_keeps_nan_under_onednn() -> None:
    # the case as found: 0 NaNs out where eager has 72
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="onednn"))
    x[0, 0, 3, 3] = math.nan
    out = fast(x)
    assert int(out.isnan().sum()) == int(m(x).isnan().sum()) == 72
    assert_matches_eager(m, out, (x,))
    (g,) = guards(fast)
    assert g.exact is not None and g.exact_calls == 1
    (group,) = fast.report.groups
    assert group.kernel.startswith("onednn(") and "guarded" in group.implementation


@pytest.mark.parametrize("impl", CONV_IMPLS)
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_conv_activation_nonfinite_inputs(act: str, impl: str | None) -> None:
    torch.manual_seed(0)
    m = Layer(nn.Conv2d(4, 8, 3, padding=1), act).eval()
    x = torch.randn(2, 4, 6, 6)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
    for kinds in ("nan", "inf", "nan+inf"):
        bad = poisoned((2, 4, 6, 6), 1, kinds)
        assert_matches_eager(m, fast(bad), (bad,))
    assert_matches_eager(m, fast(x), (x,))


@pytest.mark.parametrize("impl", CONV_IMPLS)
@pytest.mark.parametrize("where", ["input", "residual"])
def test_conv_add_relu_nonfinite(where: str, impl: str | None) -> None:
    torch.manual_seed(0)
    m = Layer(nn.Conv2d(8, 8, 1), "relu").eval()
    x, r = torch.randn(2, 8, 5, 5), torch.randn(2, 8, 5, 5)
    fast = opfuse.compile(m, (x, r), options=opfuse.Options(implementation=impl))
    bad = poisoned((2, 8, 5, 5), 2)
    args = (bad, r) if where == "input" else (x, bad)
    assert_matches_eager(m, fast(*args), args)
    assert_matches_eager(m, fast(x, r), (x, r))


@pytest.mark.parametrize("impl", LINEAR_IMPLS)
@pytest.mark.parametrize("act", ["relu", "relu6", "clamp", "hardsigmoid", "gelu"])
def test_linear_activation_nonfinite_inputs(act: str, impl: str | None) -> None:
    torch.manual_seed(0)
    m = Layer(nn.Linear(16, 24), act).eval()
    x = torch.randn(8, 16)
    with matmul_precision("high"):
        fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation=impl))
        bad = poisoned((8, 16), 3)
        assert_matches_eager(m, fast(bad), (bad,))


def test_finite_inputs_whose_sums_overflow_keep_eagers_nan() -> None:
    # No NaN or inf goes in, but products overflow to +inf and -inf, whose sum is NaN in
    # eager: the bound sees it coming
    conv = nn.Conv2d(2, 1, 1, bias=False)
    with torch.no_grad():
        conv.weight.fill_(2.0)
    m = nn.Sequential(conv, nn.ReLU()).eval()
    x = torch.full((1, 2, 4, 4), 3e38)
    x[:, 1] *= -1.0
    x[:, :, 0, 0] = 1.0
    opts = opfuse.Options(implementation="onednn")
    fast = opfuse.compile(m, (torch.randn(1, 2, 4, 4),), options=opts)
    assert int(m(x).isnan().sum()) == 15
    assert_matches_eager(m, fast(x), (x,))


def test_nan_weights_run_the_exact_path() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU()).eval()
    with torch.no_grad():
        m[0].weight[1, 0, 0, 0] = math.nan
    x = torch.randn(1, 3, 4, 4)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="onednn"))
    assert_matches_eager(m, fast(x), (x,))
    assert int(fast(x).isnan().sum()) == 16


class _Chain(nn.Module):
    """A ResNet-like chain: conv + ReLU, conv + residual + ReLU, repeated."""

    def __init__(self, c: int = 8, depth: int = 6) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(2 * depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a, b in zip(self.convs[::2], self.convs[1::2]):
            x = torch.relu(b(torch.relu(a(x))) + x)
        return x


def test_a_chain_of_guarded_convolutions_measures_its_input_once(monkeypatch: Any) -> None:
    torch.manual_seed(0)
    m = _Chain().eval()
    x = torch.randn(1, 8, 8, 8)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="onednn"))
    gs = guards(fast)
    # (the last conv's epilogue also copies into the output: no post-op, no guard)
    assert len(gs) == 11 and all(g.exact is not None for g in gs)
    measured = measuring(monkeypatch)
    assert_matches_eager(m, fast(x), (x,))
    assert measured == [(1, 8, 8, 8)]  # the graph input; then bounds travel with the values
    assert sum(g.exact_calls for g in gs) == 0
    bad = x.clone()
    bad[0, 0, 0, 0] = math.nan
    assert_matches_eager(m, fast(bad), (bad,))
    assert sum(g.exact_calls for g in gs) >= 1


def test_max_abs_bounds_every_layout_and_flags_nonfinite() -> None:
    x = torch.randn(2, 3, 4, 5)
    for t in (x, x.contiguous(memory_format=torch.channels_last), x.transpose(1, 3), x[..., ::2]):
        assert max_abs(t) >= float(t.abs().max())
        assert max_abs(t) <= float(t.abs().max()) * math.sqrt(t.numel()) * 1.0001
    assert max_abs(torch.full((4,), 1e30)) == pytest.approx(1e30)  # squares overflow
    for v in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[1, 2, 3, 4] = v
        assert max_abs(y) == math.inf
    assert max_abs(x.bfloat16()) == pytest.approx(float(x.abs().max()), rel=1e-2)
    assert max_abs(torch.empty(0)) == 0.0


@st.composite
def epilogue_cases(draw: Any) -> tuple[Any, tuple[torch.Tensor, ...], str | None]:
    """conv or linear, an activation, maybe a residual before it, any implementation,
    and NaN/inf in the input, the residual, or nowhere."""
    conv = draw(st.booleans())
    act = draw(st.sampled_from(sorted(ACTIVATIONS)))
    residual = draw(st.booleans())
    seed = draw(st.integers(0, 1000))
    torch.manual_seed(seed)
    if conv:
        layer: nn.Module = nn.Conv2d(4, 4, draw(st.sampled_from([1, 3])), padding="same")
        shape: tuple[int, ...] = (draw(st.integers(1, 2)), 4, 5, 5)
        impl = draw(st.sampled_from(CONV_IMPLS))
    else:
        layer = nn.Linear(12, 12)
        shape = (draw(st.integers(1, 9)), 12)
        impl = draw(st.sampled_from(LINEAR_IMPLS))
    poison = draw(st.sampled_from(["input", "residual" if residual else "input", "none"]))
    kinds = draw(st.sampled_from(["nan", "inf", "nan+inf"]))
    g = torch.Generator().manual_seed(seed)
    args = [torch.randn(shape, generator=g)]
    if residual:
        args.append(torch.randn(shape, generator=g))
    if poison != "none":
        args[0 if poison == "input" else 1] = poisoned(shape, seed, kinds)
    return Layer(layer, act).eval(), tuple(args), impl


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(epilogue_cases())
def test_every_epilogue_implementation_propagates_nan_and_inf_like_eager(case: Any) -> None:
    m, args, impl = case
    clean = tuple(torch.randn_like(a) for a in args)
    with matmul_precision("high"):
        fast = opfuse.compile(m, clean, options=opfuse.Options(implementation=impl))
        assert_matches_eager(m, fast(*args), args)


def test_the_tuner_times_guarded_calls_without_measuring(
    monkeypatch: Any, fresh_cache: Any
) -> None:
    # in a model a guarded call mostly runs on bounds carried from the call before it: the
    # tuner times the fused call alone, not a measurement the model would not make
    measured = measuring(monkeypatch)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(1, 8, 16, 16)
    fast = opfuse.compile(m, (x,))
    (group,) = fast.report.groups
    assert "measured" in group.implementation and "onednn" in group.implementation
    assert measured == []
    fast(x)
    assert len(measured) == (1 if guards(fast) else 0)


class _Bottlenecks(nn.Module):
    """3x3 convolutions + ReLU (oneDNN, guarded) between 1x1 ones + ReLU (opfuse's GEMM),
    as a ResNet's bottleneck alternates them; `scale` multiplies every weight."""

    def __init__(self, c: int = 16, depth: int = 3, scale: float = 1.0) -> None:
        super().__init__()
        self.wide = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(depth))
        self.narrow = nn.ModuleList(nn.Conv2d(c, c, 1) for _ in range(depth))
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for wide, narrow in zip(self.wide, self.narrow):
            x = torch.relu(narrow(torch.relu(wide(x))))
        return x


def _gemm_between_onednn(monkeypatch: Any) -> None:
    """Every 1x1 convolution on opfuse's GEMM, every other on oneDNN (NHWC), untimed."""
    _force(monkeypatch, ("opfuse-gemm", "onednn-nhwc", "onednn"))


def _force(monkeypatch: Any, names: tuple[str, ...]) -> None:
    """Each group runs the first of `names` it has as a candidate, untimed."""
    from opfuse import autotune
    from opfuse.decisions import Decision

    def choose(graph: Any, group: Any, candidates: Any, *rest: Any, **kw: Any) -> Decision:
        for name in names:
            if name in candidates:
                return Decision(name, {})
        raise AssertionError(f"no candidate to force among {sorted(candidates)}")

    monkeypatch.setattr(autotune, "load_decision", lambda key: None)
    monkeypatch.setattr(autotune, "choose", choose)


def test_bounds_travel_through_opfuses_kernels(monkeypatch: Any) -> None:
    # Each guarded call reads what opfuse's GEMM made; its bound comes from the GEMM's
    # weight and its input's bound (lower/bounds.py), so only the graph input is measured.
    _gemm_between_onednn(monkeypatch)
    torch.manual_seed(0)
    m = _Bottlenecks().eval()
    x = torch.randn(1, 16, 8, 8)
    fast = opfuse.compile(m, (x,))
    plan = next(iter(fast._entries.values())).compiled.run.plan
    kinds = [type(s).__name__ for s in plan.steps if getattr(s, "view", False) is False]
    assert kinds.count("KernelStep") == 3 and len(guards(fast)) == 3
    kernels = [s for s in plan.steps if isinstance(s, KernelStep)]
    # each GEMM before a guarded call carries bounds; the last one's output, which no guard
    # reads, carries none (it may then run inside a run of kernels called from C)
    assert [s.bound is not None for s in kernels] == [True, True, False]
    measured = measuring(monkeypatch)
    assert_matches_eager(m, fast(x), (x,))
    assert measured == [(1, 16, 8, 8)]  # the graph input (its NHWC copy) only
    assert sum(g.exact_calls for g in guards(fast)) == 0
    # NaN in the input: measured, exact path, NaN kept as eager keeps it
    bad = x.clone()
    bad[0, 3, 2, 2] = math.nan
    assert_matches_eager(m, fast(bad), (bad,))
    assert sum(g.exact_calls for g in guards(fast)) >= 1


class _WinogradBetween(nn.Module):
    """oneDNN's strided convolution + ReLU (guarded), opfuse's Winograd convolution, then
    oneDNN's again, then a 1x1 one (the graph stays channels-last up to it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.b = nn.Conv2d(16, 16, 3, padding=1)
        self.c = nn.Conv2d(16, 8, 3, stride=2, padding=1)
        self.d = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def test_bounds_travel_through_opfuses_convolutions(monkeypatch: Any) -> None:
    # The second guarded call reads what opfuse's Winograd kernel made: its bound is the
    # filters' gain times its input's bound plus the bias's, so nothing is measured again.
    _force(monkeypatch, ("opfuse-winograd", "onednn-nhwc", "onednn", "opfuse-gemm"))
    torch.manual_seed(0)
    m = _WinogradBetween().eval()
    x = torch.randn(2, 8, 12, 12)
    fast = opfuse.compile(m, (x,))
    impls = [g.implementation for g in fast.report.groups]
    assert sum(i.startswith("opfuse-winograd") for i in impls) == 1 and len(guards(fast)) == 2
    plan = next(iter(fast._entries.values())).compiled.run.plan
    conv = next(s for s in plan.steps if isinstance(s, KernelStep))  # (the 1x1's after)
    assert conv.name.startswith("fused_conv_rows") and conv.bound is not None
    measured = measuring(monkeypatch)
    assert_matches_eager(m, fast(x), (x,))
    assert len(measured) == 1  # the graph input only
    bad = x.clone()
    bad[1, 2, 3, 4] = math.inf
    assert_matches_eager(m, fast(bad), (bad,))
    assert sum(g.exact_calls for g in guards(fast)) >= 1


def test_bounds_through_kernels_see_an_overflow_coming(monkeypatch: Any) -> None:
    # Finite inputs and weights whose sums overflow float32 two layers in (inf - inf is
    # NaN in eager): the bounds carried through the GEMMs grow past LIMIT, so the guarded
    # calls measure, find inf or NaN, and run exactly
    _gemm_between_onednn(monkeypatch)
    torch.manual_seed(0)
    m = _Bottlenecks(scale=1e9).eval()
    fast = opfuse.compile(m, (torch.randn(1, 16, 8, 8),))
    x = torch.randn(1, 16, 8, 8) * 1e15
    expected = m(x)
    assert bool(expected.isnan().any())
    assert_matches_eager(m, fast(x), (x,))


def test_kernel_bounds_follow_the_op_table() -> None:
    from opfuse.ir.scalar import Expr
    from opfuse.lower.bounds import output_bounds
    from opfuse.lower.kernel import Buffer, Kernel, Pass, Store

    f32 = torch.float32

    def load(b: str) -> Expr:
        return Expr("load", (), f32, (b, None))

    def kernel(value: Expr) -> Kernel:
        bufs = tuple(Buffer(n, f32, "in", n, (4,), (1,)) for n in ("in0", "in1"))
        out = Buffer("out0", f32, "out", "out0", (4,), (1,))
        return Kernel("k", (), (*bufs, out), (), (), (Pass(stores=(Store("out0", None, value),)),))  # type: ignore[arg-type]

    leaves = {"in0": "b[1]", "in1": "2.0"}.get
    x, y = load("in0"), load("in1")
    relu = Expr("max", (x * y + 0.5, Expr("const", (), f32, 0.0)), f32)
    assert output_bounds(kernel(relu), leaves) == {"out0": "max(((b[1] * 2.0) + 0.5), 0.0)"}
    assert output_bounds(kernel(Expr("exp", (x,), f32)), leaves) == {}  # no rule: unbounded
    assert output_bounds(kernel(Expr("tanh", (x,), f32)), leaves) == {
        "out0": "(1.0 if b[1] <= LIMIT else INF)"
    }
    assert output_bounds(kernel(x), {"in0": None}.get) == {}  # an input without a bound
    from opfuse.runtime.finite import LIMIT, transfer

    t = transfer({5: "(1.0 if b[1] <= LIMIT else INF)", 6: "(b[1] * 2.0)"}, [1])
    b: list[Any] = [None] * 7
    t(b)
    assert b[5:] == [None, None]  # b[1] unknown: nothing set
    b[1] = 3.0
    t(b)
    assert b[5:] == [1.0, 6.0]
    b[1] = LIMIT
    t(b)
    assert b[5:] == [1.0, None]  # past LIMIT: no bound
