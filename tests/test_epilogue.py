"""GEMM and convolution epilogues: every op x epilogue against eager, under every
implementation (blocked GEMM, oneDNN post-ops, unfused) and under the measured choice;
structure (one group per anchor and its epilogue); model blocks end to end."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opfuse
from opfuse import autotune
from opfuse.ir.size import Size, deciding, symbolic_text, value_at
from tests.conftest import Fn, assert_matches_eager

IMPLS = [None, "unfused", "blocked", "opfuse-gemm", "onednn", "onednn-nhwc"]

EPILOGUES = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
    "swish_diamond": lambda t: t * torch.sigmoid(t),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "hardswish": F.hardswish,
    "leaky_relu": lambda t: F.leaky_relu(t, 0.2),
    "relu6": F.relu6,
    "clamp": lambda t: t.clamp(-0.5, 0.5),
    "scale_shift": lambda t: t * 0.5 + 1.0,
    "chain": lambda t: torch.relu(F.gelu(t) * 2.0) - 0.25,
}


def run(m: Any, args: tuple[Any, ...], impl: str | None) -> opfuse.FusionReport:
    m = m.eval() if isinstance(m, nn.Module) else Fn(m).eval()
    fast = opfuse.compile(m, args, options=opfuse.Options(implementation=impl))
    assert_matches_eager(m, fast(*args), args)
    return fast.report


def anchored(r: opfuse.FusionReport, pattern: str) -> list[Any]:
    return [g for g in r.groups if g.pattern == pattern]


@pytest.mark.parametrize("impl", [*IMPLS, "mkl-unfused"])
@pytest.mark.parametrize("epi", sorted(EPILOGUES))
def test_linear_epilogues(epi: str, impl: str | None) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(48, 40)
    r = run(lambda x: EPILOGUES[epi](lin(x)), (torch.randn(37, 48),), impl)
    groups = anchored(r, "gemm_epilogue")
    assert len(groups) == 1 and r.kernels_after <= 2, str(r)
    assert groups[0].ops[0] == "aten.addmm.default"


@pytest.mark.parametrize("impl", [None, "unfused", "blocked"])
@pytest.mark.parametrize(
    "case",
    [
        "mm",
        "mm_transposed_a",
        "linear_3d",
        "linear_no_bias",
        "bmm",
        "matmul_4d",
        "residual",
        "addmm_alpha_beta",
    ],
)
def test_matmul_flavours(case: str, impl: str | None) -> None:
    g = torch.Generator().manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=g)
    w, b = rnd(24, 16), rnd(24)
    cases = {
        "mm": (lambda a, c: F.gelu(a @ c), (rnd(20, 16), rnd(16, 30))),
        "mm_transposed_a": (lambda a, c: torch.relu(a.t() @ c), (rnd(16, 20), rnd(16, 30))),
        "linear_3d": (lambda a: torch.tanh(F.linear(a, w, b)) * 3, (rnd(3, 7, 16),)),
        "linear_no_bias": (lambda a: F.silu(F.linear(a, w)), (rnd(9, 16),)),
        "bmm": (lambda a, c: torch.sigmoid(torch.bmm(a, c)), (rnd(4, 12, 16), rnd(4, 16, 10))),
        "matmul_4d": (
            lambda q, k, m: (q @ k.transpose(-1, -2)) * 0.125 + m,
            (rnd(2, 3, 16, 8), rnd(2, 3, 16, 8), rnd(16, 16)),
        ),
        "residual": (lambda a, r: F.linear(a, w, b) + r, (rnd(11, 16), rnd(11, 24))),
        "addmm_alpha_beta": (
            lambda a, c, bias: torch.addmm(bias, a, c, beta=0.5, alpha=2.0).relu(),
            (rnd(10, 16), rnd(16, 12), rnd(12)),
        ),
    }
    fn, args = cases[case]
    r = run(fn, args, impl)
    assert len(anchored(r, "gemm_epilogue")) == 1, str(r)


CONVS = {
    "conv2d": lambda: nn.Conv2d(6, 8, 3, padding=1),
    "conv2d_no_bias_stride": lambda: nn.Conv2d(6, 8, 3, stride=2, bias=False),
    "conv2d_groups_dilation": lambda: nn.Conv2d(6, 8, 3, groups=2, dilation=2, padding=2),
    "depthwise": lambda: nn.Conv2d(6, 6, 3, groups=6, padding=1),
    "conv1d": lambda: nn.Conv1d(6, 8, 5, padding=2),
    "conv3d": lambda: nn.Conv3d(6, 8, 3, padding=1),
    "conv_transpose2d": lambda: nn.ConvTranspose2d(6, 8, 3, stride=2, padding=1, output_padding=1),
    "conv_transpose1d_groups": lambda: nn.ConvTranspose1d(6, 8, 3, groups=2),
}


def conv_input(name: str) -> torch.Tensor:
    dims = 1 if "1d" in name else 3 if "3d" in name else 2
    return torch.randn(2, 6, *([7] * dims), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("conv", sorted(CONVS))
@pytest.mark.parametrize("epi", ["relu", "silu", "swish_diamond", "gelu", "relu6", "scale_shift"])
def test_conv_epilogues(conv: str, epi: str, impl: str | None) -> None:
    torch.manual_seed(0)
    c = CONVS[conv]()
    r = run(lambda x: EPILOGUES[epi](c(x)), (conv_input(conv),), impl)
    groups = anchored(r, "conv_epilogue")
    assert len(groups) == 1 and r.kernels_after <= 2, str(r)


@pytest.mark.parametrize("residual_first", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_resnet_bottleneck_tail(impl: str | None, residual_first: bool) -> None:
    class Tail(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(16, 16, 1)
            self.bn = nn.BatchNorm2d(16)

        def forward(self, x: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
            y = self.bn(self.conv(x))
            # identity + conv(x) (a downsampled residual is often the first operand)
            return torch.relu(identity + y if residual_first else y + identity)

    torch.manual_seed(0)
    m = Tail().eval()
    m.bn.running_mean.uniform_(-1, 1)
    m.bn.running_var.uniform_(0.5, 2)
    x, idn = torch.randn(2, 16, 8, 8), torch.randn(2, 16, 8, 8)
    r = run(m, (x, idn), impl)
    (g,) = anchored(r, "conv_epilogue")
    assert [op.split(".")[1] for op in g.ops] == ["convolution", "add", "relu"]
    assert r.kernels_after <= 2 and len(r.folds) == 1
    if impl in ("unfused", "onednn", "onednn-nhwc"):  # convolution's; either operand order
        assert g.implementation.startswith(impl), g.implementation


def test_report_says_which_implementation_and_why() -> None:
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(64, 128), nn.GELU()).eval()
    r = opfuse.explain(lin, torch.randn(64, 64))
    (g,) = anchored(r, "gemm_epilogue")
    assert "ms" in g.implementation and g.implementation.split()[0] in (
        "blocked",
        "opfuse-gemm",
        "onednn",
        "unfused",
        "mkl-unfused",
    )
    for name in ("blocked", "opfuse-gemm", "unfused", "mkl-unfused"):
        assert name in g.implementation  # every candidate was timed
    # oneDNN's float32 GEMM only below torch's "highest" matmul precision
    assert "onednn" not in g.implementation
    # the decision is cached with the kernels: the second compile does not time again
    r2 = opfuse.explain(lin, torch.randn(64, 64))
    assert "cached decision" in anchored(r2, "gemm_epilogue")[0].implementation


def test_candidates_are_made_per_group_and_only_the_chosen_one_when_remembered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import weakref

    made: list[tuple[int, Any]] = []  # (group's makers, weak reference to the candidate)
    timed: list[int] = []
    real_made, real_choose = autotune._made, autotune.choose

    def make(makers: Any, names: Any) -> Any:
        out = real_made(makers, names)
        for c in out.values():
            made.append((id(makers), weakref.ref(c) if c is not None else None))
        return out

    def choose(graph: Any, group: Any, cands: Any, key: str, run_plan: Any, noise: Any) -> Any:
        mine = made[-1][0]
        earlier = {m for m, _ in made if m != mine}
        still = [r for m, r in made if m != mine and r is not None and r() is not None]
        # what earlier groups made is gone by now, except the one each of them chose
        assert len(still) <= len(earlier)
        timed.append(len(cands))
        return real_choose(graph, group, cands, key, run_plan)

    monkeypatch.setattr(autotune, "_made", make)
    monkeypatch.setattr(autotune, "choose", choose)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.ReLU()).eval()
    x = torch.randn(32, 64)
    opfuse.compile(m, (x,), options=opfuse.Options(debug_dir=None))
    assert len(timed) >= 2 and all(n >= 2 for n in timed)
    made.clear()
    timed.clear()
    fast = opfuse.compile(m, (x,))  # decisions remembered: only the chosen ones are made
    assert not timed
    assert len(made) == len({g for g, _ in made})
    assert_matches_eager(m, fast(x), (x,))


def test_repeated_layers_share_their_kernels() -> None:
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())]
    m = nn.Sequential(*layers).eval()
    x = torch.randn(8, 32)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="unfused"))
    assert_matches_eager(m, fast(x), (x,))
    src = fast._first.compiled.source
    assert len(anchored(fast.report, "gemm_epilogue")) == 4
    # the four relu epilogues are one function in the translation unit
    assert src.count("int fused_relu") == 1, src


def test_anchor_output_with_other_users_is_not_fused_and_says_why() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    r = run(lambda x: (torch.relu(lin(x)), torch.cumsum(lin(x), 0)), (torch.randn(8, 16),), None)
    del r
    m = Fn(lambda x, w: (lambda y: (torch.relu(y), torch.cumsum(y, 0)))(x @ w)).eval()
    rep = opfuse.explain(m, (torch.randn(8, 16), torch.randn(16, 16)))
    assert any("users" in x.reason for x in rep.rejected), [x.reason for x in rep.rejected]


class MLPBlock(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x))) + x


def test_transformer_mlp_block() -> None:
    torch.manual_seed(0)
    r = run(MLPBlock(), (torch.randn(2, 10, 64),), None)
    assert [g.pattern for g in r.groups] == ["gemm_epilogue", "gemm_epilogue"], str(r)
    assert r.groups[0].ops[1:] == ["aten.gelu.default"]  # fc1 + gelu
    assert r.groups[1].ops[1:] == ["aten.add.Tensor"]  # fc2 + residual
    r_fused = run(MLPBlock(), (torch.randn(2, 10, 64),), "blocked")
    assert r_fused.kernels_after == 2


def test_resnet_bottleneck_block() -> None:
    from opfuse.bench.models import Bottleneck

    torch.manual_seed(0)
    m = Bottleneck(32, 8, stride=1).eval()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 1.5)
    r = run(m, (torch.randn(2, 32, 8, 8),), None)
    assert len(r.folds) == 3
    # the last 1x1 convolution reads NHWC: a matmul, the residual add and ReLU its epilogue
    assert [g.pattern for g in r.groups] == ["conv_epilogue"] * 2 + ["gemm_epilogue"], str(r)
    assert r.groups[2].ops[:3] == ["aten.addmm.default", "aten.add.Tensor", "aten.relu.default"]


@pytest.mark.parametrize("impl", [None, "torch", "mkl", "blocked"])
@pytest.mark.parametrize("bias", [True, False])
def test_lone_linear_runs_as_packed_mkl_or_blocked(impl: str | None, bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(48, 40, bias=bias)
    r = run(lin, (torch.randn(3, 11, 48),), impl)
    (g,) = [g for g in r.groups if g.pattern == "library"]
    if impl == "mkl":
        assert g.kernel == f"mkl({'addmm' if bias else 'mm'})"


def test_epilogue_after_packed_mkl_gemm() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(48, 40)
    r = run(lambda x: F.gelu(lin(x)) + 1.0, (torch.randn(37, 48),), "mkl-unfused")
    (g,) = anchored(r, "gemm_epilogue")
    assert g.kernel.startswith("fused_") and "_mkl_unfused_" in g.kernel
    assert r.kernels_after == 2  # the packed GEMM, then one kernel for the whole epilogue


def test_large_weights_left_as_views_still_get_the_packed_gemm() -> None:
    # A weight of more than 4M elements is not constant-folded: the GEMM reads a transpose
    # view of it, which the packed MKL GEMM (and oneDNN) must see through
    torch.manual_seed(0)
    lin = nn.Linear(1025, 4096)
    x = torch.randn(4, 1025)
    r = run(lambda t: lin(t), (x,), "mkl")
    (g,) = anchored(r, "library")
    assert g.kernel == "mkl(addmm)", str(r)


def _amx_or_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@pytest.mark.skipif(not _amx_or_avx512_bf16(), reason="no native bfloat16 GEMM on this CPU")
@pytest.mark.parametrize("impl", ["onednn", "onednn-unfused"])
@pytest.mark.parametrize("epilogue", [True, False])
def test_bfloat16_linear_runs_onednn_with_packed_weights(impl: str, epilogue: bool) -> None:
    # MKL's packed GEMM is float32 only: bfloat16 linears get oneDNN's packed one, alone
    # (a library group) or followed by the unfused epilogue kernel
    torch.manual_seed(0)
    lin = nn.Linear(96, 80).to(torch.bfloat16)
    fn = (lambda x: F.gelu(lin(x))) if epilogue else (lambda x: lin(x))
    r = run(fn, (torch.randn(4, 33, 96, dtype=torch.bfloat16),), impl)
    (g,) = anchored(r, "gemm_epilogue" if epilogue else "library")
    if not epilogue:  # (a library group has no unfused variant: then the tuner picks)
        assert g.kernel == "onednn(addmm)" or impl == "onednn-unfused"
    elif impl == "onednn":
        assert g.kernel == "onednn(addmm, gelu)"
    else:
        assert "_onednn_unfused_" in g.kernel and r.kernels_after == 2
    measured = opfuse.explain(Fn(fn).eval(), torch.randn(4, 33, 96, dtype=torch.bfloat16))
    (g,) = anchored(measured, "gemm_epilogue" if epilogue else "library")
    assert "onednn" in g.implementation and ("onednn-unfused" in g.implementation) == epilogue


def test_group_whose_every_candidate_is_refused_runs_with_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import opfuse.pipeline as pipeline
    from opfuse.backends.c.module import Unavailable

    real = pipeline.build_modules

    def refusing(parts: Any) -> Any:
        mods = real(parts)

        def refuse() -> None:
            raise Unavailable("test: the library refuses")

        for mod in mods:
            for makers in mod.candidates.values():
                for name in makers:
                    makers[name] = refuse
        return mods

    monkeypatch.setattr(pipeline, "build_modules", refusing)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 8)).eval()
    x = torch.randn(4, 16)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))


@pytest.mark.parametrize("impl", [None, "blocked", "unfused"])
@pytest.mark.parametrize("batch", [1, 2])
def test_attention_output_transpose_after_bmm(batch: int, impl: str | None) -> None:
    # ViT/BERT attention: probs @ v, heads moved back next to the features. Each tile stores
    # its results where the transpose puts them, so it reads only the results it computed
    # (ViT-B/16 at batch 1 once gave errors of 2.9 when a tile walked the output's order
    # and read results of tiles other threads had not computed yet).
    torch.manual_seed(0)
    heads, s, d = 12, 197, 64

    def attn_out(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = torch.bmm(p, v).view(batch, heads, s, d)
        return o.transpose(1, 2).contiguous().view(batch, s, heads * d) * 1.5

    args = (torch.randn(batch * heads, s, s), torch.randn(batch * heads, s, d))
    r = run(attn_out, args, impl)
    (g,) = anchored(r, "gemm_epilogue")
    if impl == "blocked":
        assert g.implementation.startswith("blocked"), g.implementation


class _ScaledBack(nn.Module):
    """ConvNeXt's block tail: a linear over channels-last features, scaled per channel,
    permuted back to NCHW and added to the block input."""

    def __init__(self, dim: int, hidden: int, dims: tuple[int, ...]) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, dim)
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5)
        self.dims = dims

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x + (self.gamma * self.fc(h)).permute(*self.dims)


@pytest.mark.parametrize("impl", [None, "blocked", "opfuse-gemm", "unfused"])
@pytest.mark.parametrize(
    "shape", [(1, 96, 14, 14), (2, 40, 7, 9), (1, 33, 5, 1), (3, 8, 1, 1)], ids=str
)
def test_epilogue_stores_through_a_permute(shape: tuple[int, ...], impl: str | None) -> None:
    # The epilogue's output is the GEMM result permuted (NHWC -> NCHW): each tile stores its
    # elements where the permute puts them, instead of refusing the blocked GEMMs.
    torch.manual_seed(0)
    n, c, hh, ww = shape
    m = _ScaledBack(c, 3 * c + 5, (0, 3, 1, 2))
    args = (torch.randn(n, c, hh, ww), torch.randn(n, hh, ww, 3 * c + 5))
    r = run(m, args, impl)
    (g,) = anchored(r, "gemm_epilogue")
    assert {"aten.mul.Tensor", "aten.add.Tensor"} <= set(g.ops), g.ops
    if impl in ("blocked", "opfuse-gemm"):
        assert g.implementation.startswith(impl), g.implementation


@pytest.mark.parametrize("impl", ["blocked", "opfuse-gemm"])
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 70),
    k=st.integers(1, 50),
    order=st.permutations([0, 1, 2]),
)
@settings(max_examples=12, deadline=None)
def test_epilogue_through_random_views(
    impl: str, rows: int, cols: int, k: int, order: list[int]
) -> None:
    # a linear's result with its rows split in two dims and all three permuted: every
    # order stores each element once, where the views put it
    torch.manual_seed(rows * 1000 + cols)
    lin = nn.Linear(k, cols)

    def f(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = torch.relu(lin(x)).view(2, rows, cols).permute(*order)
        return y + r

    out_shape = tuple((2, rows, cols)[d] for d in order)
    args = (torch.randn(2 * rows, k), torch.randn(out_shape))
    (g,) = anchored(run(f, args, impl), "gemm_epilogue")
    assert g.implementation.startswith(impl), g.implementation


class _TwoBranches(nn.Module):
    """conv -> relu -> conv, plus a residual: the downsample conv's output (a dead torch
    result the tail may write over), the block input, or the downsample output read again."""

    def __init__(self, residual: str) -> None:
        super().__init__()
        self.residual = residual
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 16, 3, padding=1)  # (a 1x1 over NHWC would be a matmul)
        self.down = nn.Conv2d(8, 16, 1)
        self.head = nn.Conv2d(16, 4, 1)  # the next block: the tail's output stays inside

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> Any:
        identity = r if self.residual == "input" else self.down(x)
        y = self.head(torch.relu(self.b(torch.relu(self.a(x))) + identity))
        if self.residual == "read_later":
            return y, self.head(identity)
        if self.residual == "output":
            return y, identity
        return y


def _donating(fast: Any) -> list[Any]:
    from opfuse.runtime.execute import TorchStep

    steps = fast._first.compiled.run.plan.steps
    return [s for s in steps if isinstance(s, TorchStep) and s.donate is not None]


@pytest.mark.parametrize("layout", ["channels-last", "keep"])
@pytest.mark.parametrize("residual", ["dead", "input", "read_later", "output"])
def test_conv_add_writes_over_a_dead_residual_only(layout: str, residual: str) -> None:
    torch.manual_seed(0)
    m = _TwoBranches(residual).eval()
    x, r = torch.randn(2, 8, 10, 10), torch.randn(2, 16, 10, 10)
    r_before = r.clone()
    # (the 3x3 convolution as one, not Winograd's rows: oneDNN's sum post-op is under test)
    opts = opfuse.Options(implementation="onednn", layout=layout, winograd=False)
    fast = opfuse.compile(m, (x, r), options=opts)
    tail = [g for g in anchored(fast.report, "conv_epilogue") if "aten.add.Tensor" in g.ops]
    assert len(tail) == 1 and tail[0].implementation.startswith("onednn"), str(fast.report)
    # oneDNN accumulates into the residual itself when nothing else can see it
    donating = _donating(fast)
    assert len(donating) == (1 if residual == "dead" else 0)
    ran: list[int] = []
    for step in donating:  # and the runtime agrees that nothing else holds it
        real = step.inplace
        step.inplace = lambda *a, _real=real: ran.append(1) or _real(*a)
    for _ in range(3):  # the written-over tensor is the previous call's: no stale values
        assert_matches_eager(m, fast(x, r), (x, r))
    assert len(ran) == 3 * len(donating)
    assert torch.equal(r, r_before)  # a caller's tensor is never written over


class _Block(nn.Module):
    """stem -> (block input) -> conv -> relu -> conv -> + block input -> relu: the block
    input's other reader (the first conv) runs before the tail, so the tail's add may write
    over it; unless a later layer reads it again."""

    def __init__(self, read_later: bool) -> None:
        super().__init__()
        self.read_later = read_later
        self.stem = nn.Conv2d(8, 16, 3, padding=1)  # (no stem of 3 channels: oneDNN's)
        self.a = nn.Conv2d(16, 8, 1)
        self.b = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Conv2d(16, 4, 1)  # the next block: the tail's output stays inside

    def forward(self, x: torch.Tensor) -> Any:
        x0 = torch.relu(self.stem(x))
        y = torch.relu(self.b(torch.relu(self.a(x0))) + x0)
        return self.head(y * x0 if self.read_later else y)


@pytest.mark.parametrize("read_later", [False, True])
def test_the_tuner_times_the_in_place_call_the_plan_will_run(
    read_later: bool, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:

    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))  # nothing remembered: it times
    timed: list[str] = []
    real = autotune._InPlaceTiming.__init__

    def spy(self: Any, graph: Any, b: Any) -> None:
        timed.append(b.output.name)
        real(self, graph, b)

    monkeypatch.setattr(autotune._InPlaceTiming, "__init__", spy)
    torch.manual_seed(0)
    m = _Block(read_later).eval()
    x = torch.randn(2, 8, 12, 12)
    opts = opfuse.Options(layout="channels-last", winograd=False)  # (3x3 convolutions)
    fast = opfuse.compile(m, (x,), options=opts)
    tail = [g for g in anchored(fast.report, "conv_epilogue") if "aten.add.Tensor" in g.ops]
    assert len(tail) == 1
    assert len(timed) == (0 if read_later else 1), (timed, str(fast.report))
    stem = [g for g in anchored(fast.report, "conv_epilogue") if g not in tail]
    # oneDNN writes over the block input only where torch made it: an unfused stem (the
    # tuner's pick on a loaded machine) leaves its relu to a kernel, whose result it is not
    if all(g.implementation.startswith("onednn") for g in tail + stem):
        assert len(_donating(fast)) == (0 if read_later else 1)
    assert_matches_eager(m, fast(x), (x,))


def test_a_residual_read_through_views_is_still_written_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The block's 1x1 convolution as MKL's GEMM (through torch) reads the block input
    # through views (its rows); those views lived in the plan until the input's last read,
    # the tail's call, so the tail never wrote over it. A view now lets go at its own last
    # read. (The tuner's pick between this and opfuse's GEMM made the test above flaky.)
    from opfuse.runtime import execute

    donated: list[bool] = []
    real = execute._donate
    monkeypatch.setattr(execute, "_donate", lambda *a: donated.append(real(*a)) or donated[-1])
    torch.manual_seed(0)
    m = _Block(False).eval()
    x = torch.randn(2, 8, 12, 12)
    opts = opfuse.Options(layout="channels-last", winograd=False, implementation="mkl-unfused")
    fast = opfuse.compile(m, (x,), options=opts)
    used = [g.implementation.split(" ")[0] for g in fast.report.groups]
    assert used == ["onednn", "mkl-unfused", "onednn", "mkl-unfused"], used
    assert len(_donating(fast)) == 1
    for _ in range(2):
        assert_matches_eager(m, fast(x), (x,))
    assert donated == [True, True]


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_float32_onednn_gemm_only_where_the_user_allows_less_precision(precision: str) -> None:
    # oneDNN's packed float32 GEMM is faster here than MKL's but 2-3x further from float64:
    # a candidate only below torch's "highest" float32 matmul precision
    m = nn.Sequential(nn.Linear(64, 128), nn.Softmax(-1), nn.Linear(128, 32)).eval()
    x = torch.randn(32, 64)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        report = opfuse.explain(m, (x,))
    finally:
        torch.set_float32_matmul_precision(before)
    timed = " ".join(g.implementation for g in report.groups if g.pattern == "library")
    assert timed.count("onednn ") == (2 if precision == "high" else 0), timed


class _StandardisedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(8, 16, 3, padding=1)
        mask = torch.ones_like(self.c.weight)
        mask[:, :, 2:] = 0  # a causal (PixelCNN-style) mask
        self.register_buffer("mask", mask)
        self.g = nn.Parameter(torch.rand(16, 1, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.c.weight * self.mask
        m, s = w.mean((1, 2, 3), keepdim=True), w.std((1, 2, 3), keepdim=True)
        v = torch.var_mean(w, (1, 2, 3), keepdim=True)[1]  # a tuple-valued reduction too
        w = self.g * (w - m) / (s + 1e-5) + 0 * v
        return F.silu(F.conv2d(x, w, self.c.bias, padding=1))


def test_weight_arithmetic_on_frozen_parameters_runs_once_at_compile_time() -> None:
    # Weight standardisation, masks, weight norm: in eval mode everything computed from
    # parameters alone (reductions included) is a constant, and the conv that reads it is
    # the only kernel left, with its epilogue and a prepacked weight.
    torch.manual_seed(0)
    x = torch.randn(2, 8, 12, 12)
    for m in (
        _StandardisedConv().eval(),
        nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)).eval(),
    ):
        args = (x,) if isinstance(m, _StandardisedConv) else (torch.randn(4, 8),)
        fast = opfuse.compile(m, args)
        assert_matches_eager(m, fast(*args), args)
        groups = fast.report.groups
        assert len(groups) == 1, str(fast.report)
        assert groups[0].pattern in ("conv_epilogue", "gemm_epilogue", "library"), str(fast.report)


@pytest.mark.parametrize("threads", [2, 3, 4, 8])
@pytest.mark.parametrize(("m", "n"), [(1576, 3072), (2048, 4096), (1024, 3072), (300, 3072)])
def test_gemm_tiles_fit_in_cache_keep_rows_tall_and_come_in_whole_rounds(
    m: int, n: int, threads: int
) -> None:
    from types import SimpleNamespace

    from opfuse.lower.gemm_tiles import TILE_MAX_ELEMENTS, tiles

    tm, tn = tiles(SimpleNamespace(m=m, n=n, batch=1), threads)  # type: ignore[arg-type]
    count = -(-m // tm) * -(-n // tn)
    assert tm * tn <= TILE_MAX_ELEMENTS or (tm <= 128 and tn <= 512)
    # Columns split before rows: every row tile streams the whole weight again (ViT-B's
    # MLP in 15 tiles of 112x3072 read its 9 MB weight 15 times: the epilogue cost 32%).
    assert tm >= min(m, 128)
    if m >= 128 * threads:
        assert count % threads == 0 or count > 4 * threads, (tm, tn, count)


@pytest.mark.parametrize(("m", "n", "mkl", "own"), [(40, 672, 384, 352), (40, 960, 512, 480)])
def test_opfuse_gemm_splits_columns_in_its_panels(m: int, n: int, mkl: int, own: int) -> None:
    """Few rows: the threads share the columns, MKL's in multiples of 64, opfuse's GEMM
    in its panels of 32 (672 columns went 12 panels to one thread, 9 to the other)."""
    torch.manual_seed(0)
    lin = nn.Linear(32, n)  # (A in L1: opfuse's GEMM splits columns too)
    x = torch.randn(m, 32)
    mod = Fn(lambda t: F.hardswish(lin(t))).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split is per thread
    try:
        for impl, tn in (("blocked", mkl), ("opfuse-gemm", own)):
            fast = opfuse.compile(mod, (x,), options=opfuse.Options(implementation=impl))
            assert_matches_eager(mod, fast(x), (x,))
            (g,) = fast.report.groups
            assert g.implementation.startswith(impl) and f"tiles {m}x{tn}," in g.source_code
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("m", "k", "n", "tile"),
    [
        (196, 672, 112, (98, 112)),  # A past L1, B in L2: rows split
        (49, 960, 160, (25, 160)),
        (49, 160, 960, (49, 480)),  # A in L1: columns, in panels of 32
        (128, 768, 3072, (128, 1536)),  # B past L2 (BERT's MLP): columns
        (3136, 64, 256, (1568, 256)),  # rows enough for a tile each: as MKL's
    ],
)
def test_opfuse_gemm_splits_rows_where_a_short_matrix_would_reread_its_input(
    m: int, k: int, n: int, tile: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from opfuse.lower import gemm_tiles

    monkeypatch.setattr(gemm_tiles, "l1_bytes", lambda: 48 << 10)
    monkeypatch.setattr(gemm_tiles, "l2_bytes", lambda: 1 << 20)
    spec = SimpleNamespace(m=m, k=k, n=n, batch=1, packable=True)
    assert gemm_tiles.own_tiles(spec, 2) == tile  # type: ignore[arg-type]
    # a B the kernel packs (attention's), each thread would pack whole: columns
    spec = SimpleNamespace(m=m, k=k, n=n, batch=1, packable=False)
    assert gemm_tiles.own_tiles(spec, 2) == gemm_tiles.tiles(spec, 2, panel=32)  # type: ignore[arg-type]


@pytest.mark.parametrize("threads", [2, 8])
def test_opfuse_gemm_tiles_at_a_symbolic_row_count_are_one_expression_of_it(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a symbolic M, opfuse's GEMM takes its tiles as expressions of M that decide
    nothing (the kernel computes them as it runs): one text for every M, the split of the
    table above at its sizes below the rows split, whole panels of columns, and the rows
    split from 128 rows per thread, in tiles that fit."""
    from types import SimpleNamespace

    from opfuse.lower import gemm_tiles

    monkeypatch.setattr(gemm_tiles, "l1_bytes", lambda: 48 << 10)
    monkeypatch.setattr(gemm_tiles, "l2_bytes", lambda: 1 << 20)
    for k, n in ((672, 112), (960, 160), (160, 960), (768, 3072), (64, 256), (512, 50000)):
        texts = set()
        for m in (3, 49, 128, 196, 255, 256, 1000, 3136, 40000):
            s = Size.symbol("s0", 7)
            spec = SimpleNamespace(m=s, k=k, n=n, batch=1, packable=True)
            with deciding() as log:
                tm, tn = gemm_tiles.own_tiles(spec, threads)  # type: ignore[arg-type]
            assert len(log) == 0
            with symbolic_text():
                texts.add(f"{tm} {tn}")
            tm, tn = (value_at(x, {"opfuse_s0": m}) for x in (tm, tn))
            assert tm >= 1 and (tn % 32 == 0 or tn >= n)
            if threads == 2 and m in (49, 196) and (k, n) != (512, 50000):  # (below the rows split)
                fixed = SimpleNamespace(m=m, k=k, n=n, batch=1, packable=True)
                static = gemm_tiles.own_tiles(fixed, 2)  # type: ignore[arg-type]
                assert (min(tm, m), min(tn, n)) == static, (m, k, n)
            if m >= 128 * threads:  # rows for every thread (a vocabulary's columns in blocks)
                assert tn == n or tm * tn <= gemm_tiles.TILE_MAX_ELEMENTS
                assert -(-m // tm) >= threads
        assert len(texts) == 1


def test_opfuse_gemm_row_tiles_match_eager() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(672, 112)
    x, res = torch.randn(196, 672), torch.randn(196, 112)
    mod = Fn(lambda t, r: F.hardswish(lin(t)) + r).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        opts = opfuse.Options(implementation="opfuse-gemm")
        fast = opfuse.compile(mod, (x, res), options=opts)
        assert_matches_eager(mod, fast(x, res), (x, res))
        (g,) = fast.report.groups
        assert "tiles 98x112," in g.source_code, g.source_code[:300]
    finally:
        torch.set_num_threads(threads)


def test_blocked_gemm_scratch_holds_a_tile_per_thread_not_the_whole_result() -> None:
    # Each thread computes its tiles in its own slot: the scratch needs threads x tile,
    # not the [m, n] result (BERT-base's MLP at batch 8 kept 12.6 MB for it).
    from opfuse.runtime.execute import KernelStep, Scratch

    torch.manual_seed(0)
    lin = nn.Linear(64, 2048)
    x = torch.randn(1024, 64)
    m = Fn(lambda t: F.gelu(lin(t))).eval()
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="blocked"))
    assert_matches_eager(m, fast(x), (x,))
    plan = fast._first.compiled.run.plan
    (step,) = [s for s in plan.steps if isinstance(s, KernelStep)]
    (scratch,) = [a for a in step.args if isinstance(a, Scratch)]
    threads = max(torch.get_num_threads(), os.cpu_count() or 1)
    assert scratch.nbytes <= 4 * threads * (1 << 19) < 4 * 1024 * 2048, scratch.nbytes
    # the epilogue reads the slot relative to the tile's origin (no pointer to the place
    # the element would have in a full result, which lies outside the scratch)
    src = fast._first.compiled.source
    assert "const float *restrict in0 = tile;" in src and "-1*n0]" in src, src
    # more threads than slots at run time: the kernel runs on no more than it has
    old = torch.get_num_threads()
    torch.set_num_threads(old * 4)
    try:
        assert_matches_eager(m, fast(x), (x,))
    finally:
        torch.set_num_threads(old)


def test_the_tuner_times_a_blocked_gemm_behind_a_view_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Linear on a 3-D input: view -> addmm -> view -> gelu. The GEMM's only outside reader
    # is the view the epilogue reads through; the tuner's subgraph made it an output, so
    # torch computed the GEMM again after the blocked kernel and blocked timed 2x its cost.
    from opfuse.runtime.execute import TorchStep

    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    plans: list[list[str]] = []
    real = autotune._sub_runtime

    def spy(graph: Any, part: Any, built: Any) -> Any:
        rt = real(graph, part, built)
        steps = getattr(getattr(rt, "plan", None), "steps", [])
        plans.append([s.name for s in steps if isinstance(s, TorchStep)])
        return rt

    monkeypatch.setattr(autotune, "_sub_runtime", spy)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU()).eval()
    x = torch.randn(2, 24, 32)
    fast = opfuse.compile(m, (x,))
    (g,) = anchored(fast.report, "gemm_epilogue")
    assert "blocked" in g.implementation, g.implementation  # it was a candidate
    # the unfused candidates call addmm themselves; the blocked one must not call it at all
    assert any("addmm" not in p for p in plans), plans
    assert_matches_eager(m, fast(x), (x,))


@pytest.mark.parametrize("epilogue", [True, False])
def test_float32_linear_over_k_blocks_of_onednn_keeps_mkls_accuracy(epilogue: bool) -> None:
    # At torch's "highest" matmul precision oneDNN's one-call float32 GEMM is no candidate
    # (one K chain: 2-2.5x further from float64 than MKL's); in K blocks it is, alone (a
    # library group) or before the unfused epilogue kernel.
    torch.manual_seed(0)
    lin = nn.Linear(300, 96)
    fn = (lambda x: F.gelu(lin(x)) + 1) if epilogue else (lambda x: lin(x))
    impl = "onednn-kblocks-unfused" if epilogue else "onednn-kblocks"
    r = run(fn, (torch.randn(4, 33, 300),), impl)
    (g,) = anchored(r, "gemm_epilogue" if epilogue else "library")
    if epilogue:
        assert "_onednn-kblocks_unfused_" in g.kernel and r.kernels_after == 2
    else:
        assert g.kernel == "onednn-kblocks(addmm)"
    measured = opfuse.explain(Fn(fn).eval(), torch.randn(4, 33, 300))
    (g,) = anchored(measured, "gemm_epilogue" if epilogue else "library")
    assert "onednn-kblocks" in g.implementation  # timed with the others
    short = nn.Linear(64, 96)  # one block: oneDNN's one call, not a candidate
    r = opfuse.explain(short.eval(), torch.randn(8, 64))
    assert "onednn" not in anchored(r, "library")[0].implementation


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(1, 200),
    k=st.integers(65, 1200),
    n=st.integers(1, 300),
    seed=st.integers(0, 10_000),
    bias=st.booleans(),
)
def test_k_blocked_onednn_gemm_is_as_close_to_float64_as_eager(
    m: int, k: int, n: int, seed: int, bias: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    x = torch.randn(m, k, generator=g)
    run(lin, (x,), "onednn-kblocks")


def _kernel_steps(fast: Any) -> list[Any]:
    from opfuse.runtime.execute import KernelStep

    return [s for s in fast._first.compiled.run.plan.steps if isinstance(s, KernelStep)]


def test_gemm_epilogue_writes_over_a_dead_residual() -> None:
    # ResNet's block tail on opfuse's GEMM: relu(conv1x1(h) + x), x dead after it. The
    # result takes x's pooled block (no fresh output, whose every line is read before it
    # is written); x's other reader, the block's first convolution, ran before.
    from opfuse.bench.models import Bottleneck
    from opfuse.runtime.execute import In, Out

    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        Bottleneck(32, 8, stride=1),
        nn.Conv2d(32, 4, 3, padding=1),  # the next layer: the tail's result stays inside
    ).eval()
    x = torch.randn(2, 3, 8, 8)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="opfuse-gemm"))
    (tail,) = [s for s in _kernel_steps(fast) if s.name.startswith("fused_addmm_add_relu")]
    ((o, i),) = tail.inplace
    out, res = tail.args[o], tail.args[i]
    assert isinstance(out, Out) and isinstance(res, In)
    assert out.block is not None or out.steal == i  # the residual's memory
    for _ in range(3):  # each call writes over that call's residual, never a stale one
        assert_matches_eager(m, fast(x), (x,))


@pytest.mark.parametrize("rows", [16, 512])
def test_gemm_epilogue_never_writes_over_its_own_input(rows: int) -> None:
    # relu(x @ W + x): the epilogue reads x at the very elements it writes, but the GEMM
    # tiles of other threads read whole rows of x (16 rows: two column tiles of the same
    # rows), so the output must not take x's memory
    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(256, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2.0  # a kernel's result, pooled: its block could be taken
            return torch.relu(self.fc(h) + h)

    torch.manual_seed(0)
    m = Res().eval()
    x = torch.randn(rows, 256)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="opfuse-gemm"))
    gemm = [s for s in _kernel_steps(fast) if s.name.startswith("fused_addmm")]
    assert len(gemm) == 1 and gemm[0].inplace == []
    for _ in range(3):
        assert_matches_eager(m, fast(x), (x,))
