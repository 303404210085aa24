"""The Triton backend, run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1):
the same lowered kernels as the C backend, rendered as @triton.jit functions.

On a GPU machine, `OPFUSE_TEST_DEVICE=cuda python -m pytest tests/test_triton.py` runs the
same tests compiled for the GPU: every tensor the tests make is created there."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opfuse
from opfuse.frontend.dynamo import collect_reports
from opfuse.pipeline import Options
from opfuse.runtime.execute import KernelStep

pytest.importorskip("triton")
DEVICE = os.environ.get("OPFUSE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when a generated module is imported
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="compares with the C backend on the CPU")


@pytest.fixture(autouse=True)
def _on_device() -> Iterator[None]:
    with torch.device(DEVICE):  # tensors and modules the test makes
        yield


TRITON = Options(backend="triton")


def _steps(f: opfuse.CompiledModule) -> list[KernelStep]:
    entry = next(iter(f._entries.values()))
    assert entry.compiled is not None
    return [s for s in entry.compiled.run.plan.steps if isinstance(s, KernelStep)]


def _check(
    model: nn.Module | object, *args: torch.Tensor, tol: float = 1e-5
) -> opfuse.CompiledModule:
    m = model if isinstance(model, nn.Module) else _Fn(model)
    m.eval()
    f = opfuse.compile(m, args, options=TRITON)
    with torch.no_grad():
        got, want = f(*args), m(*args)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, atol=tol, rtol=tol, equal_nan=True)
    return _check_steps(f)


class _Fn(nn.Module):
    def __init__(self, fn: object) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> object:
        return self.fn(*args)  # type: ignore[operator]


def test_elementwise_chain_is_one_triton_kernel() -> None:
    x = torch.randn(33, 65)
    f = _check(lambda t: torch.tanh(torch.sigmoid(t.sin() * 1.5).relu() + 0.25) - 0.5, x)
    assert f.report.kernels_after == 1
    [g] = f.report.groups
    assert g.pattern == "elementwise"
    assert "@triton.jit" in g.source_code and "tl.store(out0" in g.source_code
    assert f.report.backend.startswith("triton (Options.backend")
    assert "backend: triton" in str(f.report)


def test_broadcast_strided_and_transposed_inputs() -> None:
    a = torch.randn(16, 32).t()  # transposed view
    b = torch.randn(32, 1)
    c = torch.randn(32)[::2]  # strided
    f = _check(lambda a, b, c: F.gelu(a * b + c) - a.exp(), a, b, c)
    assert f.report.kernels_after == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_layernorm_of_residual_add_is_one_kernel(dtype: torch.dtype) -> None:
    m = nn.LayerNorm(96).to(dtype)
    nn.init.normal_(m.weight)
    nn.init.normal_(m.bias)
    x, r = torch.randn(4, 10, 96, dtype=dtype), torch.randn(4, 10, 96, dtype=dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    f = _check(lambda x, r: m(x + r), x, r, tol=tol)
    assert f.report.kernels_after == 1
    assert f.report.groups[0].pattern == "reduction"


def test_softmax_rmsnorm_and_statistics() -> None:
    x = torch.randn(6, 300) * 3
    w = torch.randn(300)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return x.softmax(-1), rms, x.relu().sum(), x.var(0), x.mean(0), x.std(1)

    _check(fn, x)


def test_arg_and_logical_reductions_follow_torch() -> None:
    x = torch.randint(-3, 4, (5, 40)).float()  # ties: the first index wins
    x[1, 7] = float("nan")  # NaN is the maximum and the minimum
    x[2, :] = float("-inf")

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            x.argmax(1),
            x.argmin(1),
            x.amax(1),
            x.amin(0),
            (x > 2).any(1),
            (x > -4).all(1),
            # small factors: exact in any order (with nan_to_num's 3.4e38 the order
            # decides between inf * 0 = NaN and 0, and torch's CUDA order is not ours)
            x.nan_to_num(0.5, 2.0, -2.0).prod(0),
        )

    _check(fn, x)


def test_integer_and_comparison_ops() -> None:
    a = torch.randint(-50, 50, (8, 33))
    b = torch.randint(1, 7, (8, 33))
    c = torch.randn(8, 33)

    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            torch.where(a > 0, c, -c) * 2,
            torch.remainder(c * 7, 3.0),
            torch.floor_divide(c * 7, 2.0),
            (a & 6) | (a ^ 3),
            torch.maximum(c, c.flip(0)),
            # constant divisors need no zero check: C truncation fixed up as torch rounds
            torch.div(a, 3, rounding_mode="floor"),
            torch.div(a, -4, rounding_mode="trunc"),
            torch.remainder(a, 5),
            torch.fmod(a, -4),
        )

    _check(fn, a, b, c)


def test_alpha_and_lerp_round_once() -> None:
    a = torch.randn(8, 33)
    b = torch.randn(8, 33)
    i = torch.randint(-50, 50, (8, 33))

    def fn(a: torch.Tensor, b: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            torch.add(a, b, alpha=2.5),
            torch.rsub(a * 2, b, alpha=0.5),
            torch.lerp(a, b, 0.3),
            torch.lerp(a, b, b.sigmoid()),
            torch.sub(i, i.flip(0), alpha=3),
        )

    f = _check(fn, a, b, i)
    assert "fma(" in f.report.groups[0].source_code


def test_gemm_epilogue_runs_the_matmul_with_torch_and_the_epilogue_in_triton() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(8, 32)
    f = _check(lambda x: m(x) + x, x)
    patterns = [g.pattern for g in f.report.groups]
    assert "gemm_epilogue" in patterns
    epi = next(g for g in f.report.groups if g.pattern == "gemm_epilogue")
    assert "aten.gelu.default" in epi.ops and "unfused" in epi.kernel


def test_training_through_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPFUSE_BACKEND", "triton")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.SiLU(), nn.Linear(32, 4))
    twin = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.SiLU(), nn.Linear(32, 4))
    twin.load_state_dict(m.state_dict())
    x = torch.randn(12, 16)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="opfuse")
    compiled(x).square().mean().backward()
    twin(x).square().mean().backward()
    for p, q in zip(m.parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
    # forward and backward graphs both ran Triton kernels
    report = collect_reports(m, (x,), {}, backward=True)
    triton_groups = [g for g in report.groups if "@triton.jit" in g.source_code]
    assert len(triton_groups) >= 4
    assert {g.pattern for g in triton_groups} == {"reduction"}  # LayerNorm, its backward, sums
    torch._dynamo.reset()


@cpu_only
def test_cpu_tensors_without_the_interpreter_run_with_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(40, 7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = opfuse.compile(_Fn(lambda t: t.sin() * 2 + 1).eval(), (x,), options=TRITON)
        torch.testing.assert_close(f(x), x.sin() * 2 + 1)
    assert not _steps(f)
    assert any("interpreter" in str(w.message) for w in caught)


def test_backend_option_is_checked() -> None:
    with pytest.raises(ValueError, match="backend"):
        Options(backend="cuda")


_UNARY = [torch.sin, torch.exp, torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.erf,
          lambda t: t * 0.5, lambda t: t + 1.25, torch.neg, F.silu, F.gelu]  # fmt: skip
_BINARY = [torch.add, torch.mul, torch.sub, torch.maximum, torch.minimum]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_random_pointwise_dags_and_reductions(data: st.DataObject) -> None:
    rows = data.draw(st.integers(1, 9))
    cols = data.draw(st.integers(1, 70))
    transposed = data.draw(st.booleans())
    x = torch.randn(cols, rows).t() if transposed else torch.randn(rows, cols)
    y = torch.randn(rows, cols)
    plan = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(_UNARY) - 1), st.integers(0, len(_BINARY) - 1)),
            min_size=1,
            max_size=6,
        )
    )
    reduce = data.draw(st.sampled_from(["none", "sum", "amax", "mean", "softmax"]))

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        vals = [x, y]
        for u, b in plan:
            vals.append(_BINARY[b](_UNARY[u](vals[-1]), vals[-2]))
        out = vals[-1]
        if reduce == "softmax":
            return out.softmax(-1)
        if reduce != "none":
            return getattr(out, reduce)(-1)
        return out

    _check(fn, x, y, tol=1e-4)


@pytest.mark.parametrize("reduce", [False, True])
def test_integer_division_by_zero_follows_torch(reduce: bool) -> None:
    """torch raises on the CPU; its CUDA kernels give the hardware's quotient, unchecked:
    ours check (a flag the launcher reads) only where torch does."""
    a = torch.randint(-50, 50, (6, 9))
    b = torch.randint(1, 5, (6, 9))

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        q = torch.div(a, b, rounding_mode="floor") + torch.remainder(a, b)
        return q.sum(1) if reduce else q

    f = _check(fn, a, b)
    [g] = f.report.groups
    assert g.source_code.count("@triton.jit") == 1
    reads_flag = g.source_code.endswith("    return int(err.item())\n")
    assert reads_flag == (DEVICE == "cpu")
    b[3, 4] = 0
    if DEVICE == "cpu":
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            f(a, b)
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            fn(a, b)
    else:
        fn(a, b), f(a, b)  # neither raises
        torch.cuda.synchronize()


def test_a_row_reduction_walks_the_row_in_masked_chunks() -> None:
    x = torch.randn(5, 300)
    f = _check(lambda x: x - x.amax(1, keepdim=True), x)
    src = f.report.groups[0].source_code
    assert src.count("for roff in range(0, 300, RBLOCK):") == 2  # max, then the stores
    assert "mask=rmask" in src and "tl.reduce(acc0_lvalue, 1, op_max)" in src


def test_a_pass_reading_back_an_earlier_store_waits_at_a_barrier() -> None:
    """Softmax stores exp(x - max) in its second pass and divides it in the third; on a GPU
    the element read back may have been stored by another thread of the program (seen on
    an H200 with a bool mask: 0.8 off), so a barrier goes between such passes."""
    x = torch.randn(2, 3, 40, 40)
    causal = torch.ones(40, 40, dtype=torch.bool).triu(1)
    f = _check(lambda x, c: x.masked_fill(c, float("-inf")).softmax(-1), x, causal)
    [g] = f.report.groups
    src = g.source_code
    passes = src.split("for roff in range")
    assert len(passes) == 4 and src.count("tl.debug_barrier()") == 1
    assert "tl.store(out0" in passes[2] and "tl.load(out0" in passes[3]
    assert passes[2].rstrip().endswith("tl.debug_barrier()")
    g2 = _check(lambda x: x.amax(-1), x).report.groups[0]
    assert "debug_barrier" not in g2.source_code  # nothing stored before a later pass


def test_a_few_long_rows_split_across_programs() -> None:
    """x.sum() over a long row in one program leaves a GPU idle (40x slower than torch on
    an H200): each row is cut into pieces, one program each, and a second kernel combines
    the pieces' partials (sums, NaN-propagating maxima, argmax ties, Welford, any/all,
    integer sums) before the stores after the reduction."""
    x = torch.randn(3, 40000)
    x[1, 777] = float("nan")
    x[2, 5] = x[2, 30000] = 9.0  # a tie: the first index wins

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        var, mean = torch.var_mean(x, 1)
        return (
            x.relu().sum() * 0.5,
            var,
            mean,
            x.argmax(1),
            x.amin(1),
            (x > 3.5).any(1),
            (x * 10).int().sum(1),
        )

    f = _check(fn, x, tol=1e-4)
    split = [g for g in f.report.groups if "pieces" in g.source_code]
    assert split and all("_merge[(" in g.source_code for g in split)
    assert (
        "pieces"
        not in _check(lambda t: t.sum(1), torch.randn(512, 300)).report.groups[0].source_code
    )  # many rows: one program per XBLOCK rows, as before


def test_a_kernel_failing_its_trial_launch_runs_with_torch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import opfuse.backends.triton.build as tb

    real = tb.render_kernel

    def broken(name: str, k: object, checks: bool = True) -> str:  # a launch that fails,
        # as a compile error would
        src = real(name, k, checks)  # type: ignore[arg-type]
        return src.replace("    return 0\n", "    raise RuntimeError('no')\n")

    monkeypatch.setattr(tb, "render_kernel", broken)
    x = torch.randn(10, 30)
    with caplog.at_level("WARNING", logger="opfuse.triton"):
        f = opfuse.compile(_Fn(lambda t: (t.exp() * 2).sum(1)).eval(), (x,), options=TRITON)
    torch.testing.assert_close(f(x), (x.exp() * 2).sum(1))
    assert not _steps(f)
    assert "failed its trial launch" in caplog.text


@cpu_only
def test_auto_backend_is_c_for_cpu_graphs_and_says_why() -> None:
    x = torch.randn(8, 8)
    f = opfuse.compile(_Fn(lambda t: t.relu() * 2).eval(), (x,))
    assert f.report.backend == "c (tensors on the CPU)"
    assert _steps(f) and not any(s.tensors for s in _steps(f))
    assert "backend:" not in str(f.report)  # the default is not repeated in the table


@cpu_only
def test_dropout_masks_drawn_in_the_kernel_match_the_c_backend() -> None:
    class Drop(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(x.sin(), 0.3, training=True) * 2

    x = torch.randn(64, 33)
    in_c = opfuse.compile(Drop().eval(), (x,))
    in_triton = _check_steps(opfuse.compile(Drop().eval(), (x,), options=TRITON))
    assert in_triton.report.random and in_c.report.random  # drawn inside the kernels
    torch.manual_seed(1)
    a = in_c(x)
    torch.manual_seed(1)
    b = in_triton(x)
    assert torch.equal(a != 0, b != 0)  # the same SplitMix64 stream from the same seed
    torch.testing.assert_close(a, b)  # (sin may differ in the last bit between libms)
    kept = b != 0
    assert 0.6 < kept.float().mean().item() < 0.8
    torch.testing.assert_close(b[kept], (x.sin() * 2 / 0.7)[kept])


def _check_steps(f: opfuse.CompiledModule) -> opfuse.CompiledModule:
    steps = _steps(f)
    assert steps and all(s.tensors for s in steps), "every kernel runs as a Triton launch"
    return f


def test_shifts_and_integer_powers_follow_torch() -> None:
    a = torch.randint(-(2**40), 2**40, (5, 17))
    s = torch.randint(0, 70, (5, 17))

    def fn(a: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = torch.pow(a % 7 - 3, s % 9 - 2)  # integer powers, negative exponents included
        return a >> 3, a << 5, (a >> s) + 1, (a << s) - 1, p

    _check(fn, a, s)


def test_dropout_backward_redraws_the_forward_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPFUSE_BACKEND", "triton")
    drop = nn.Dropout(0.25).train()
    x = torch.randn(48, 40, requires_grad=True)
    torch._dynamo.reset()
    report = collect_reports(drop, (x,), {}, backward=True)
    assert report.random and any("@triton.jit" in g.source_code for g in report.groups)
    x.grad = None
    compiled = torch.compile(drop, backend="opfuse")
    y = compiled(x)
    y.square().sum().backward()
    assert x.grad is not None
    kept = (y != 0).float()
    torch.testing.assert_close(x.grad, 2 * y * kept / 0.75)
    torch._dynamo.reset()


def test_integer_and_half_reductions() -> None:
    i = torch.randint(-1000, 1000, (7, 45))
    h = torch.randn(7, 45, dtype=torch.float16)

    def fn(i: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            i.sum(1),
            i.to(torch.int32).argmax(0),
            i.amax(1),
            i.amin(0),
            (i % 3).prod(1),
            h.sum(1),
            h.float().softmax(0).half(),
            h.amax(0),
        )

    _check(fn, i, h, tol=2e-3)


def test_channels_last_statistics_and_group_norm() -> None:
    x = torch.randn(4, 16, 9, 11).to(memory_format=torch.channels_last)
    gn = nn.GroupNorm(4, 16)
    nn.init.normal_(gn.weight)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        var, mean = torch.var_mean(x, (0, 2, 3))
        return var, mean, F.silu(gn(x)), x.amax((2, 3))

    _check(fn, x, tol=1e-4)


def test_pools_are_window_reductions() -> None:
    x = torch.randn(2, 8, 13, 14)

    def fn(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            F.max_pool2d(t.relu(), 3, 2, 1, ceil_mode=True),
            F.avg_pool2d(t, 3, 1, 1, count_include_pad=False) - t,
            F.max_pool2d(t, 9, 1, 4),  # one pass per dimension
        )

    for t in (x, x.to(memory_format=torch.channels_last)):
        f = _check(fn, t, tol=1e-5)
        assert [g.pattern for g in f.report.groups] == ["reduction"] * 4
        assert len(f.report.pools) == 3


@pytest.mark.skipif(DEVICE == "cpu", reason="needs GPU tensors")
def test_auto_backend_is_triton_for_gpu_graphs() -> None:
    x = torch.randn(64, 64)
    f = opfuse.compile(_Fn(lambda t: (t.relu() * 2).softmax(-1)).eval(), (x,))
    assert f.report.backend.startswith("triton (tensors on cuda")
    _check_steps(f)
    torch.testing.assert_close(f(x), (x.relu() * 2).softmax(-1))


def _kept_sources(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The Triton modules loaded from now on, as source text."""
    from opfuse.backends.triton import build as triton_build

    sources: list[str] = []
    real = triton_build.load

    def keep(source: str) -> object:
        sources.append(source)
        return real(source)

    monkeypatch.setattr(triton_build, "load", keep)
    return sources


def _norm_scores(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Rows, row lengths and a softmax over the rows: all sized by the row count."""
    h = F.layer_norm(x + y.tanh(), (x.shape[-1],))
    return torch.softmax(h @ h.transpose(0, 1), -1).sum(0) * 2


def _check_one_jit_set(sources: list[str]) -> None:
    jit = [_jit_functions(s) for s in sources]
    assert len(jit) == 3 and jit[0] and jit[0] == jit[1] == jit[2]
    assert any("opfuse_s" in j for j in jit[0])


def test_symbolic_sizes_render_one_jit_function_for_every_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under dynamic=True each size compiles, and each renders the same @triton.jit
    functions (sizes as parameters the launcher passes), so Triton compiles them once per
    block shape; rows, row lengths and a softmax over the symbolic length match eager."""
    monkeypatch.setenv("OPFUSE_BACKEND", "triton")
    sources = _kept_sources(monkeypatch)
    torch._dynamo.reset()
    f = torch.compile(_norm_scores, backend="opfuse", dynamic=True)
    with torch.no_grad():
        for n in (70, 90, 100):
            x, y = torch.randn(n, 24), torch.randn(n, 24)
            torch.testing.assert_close(f(x, y), _norm_scores(x, y), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    _check_one_jit_set(sources)


def test_opfuse_compile_over_lengths_renders_one_jit_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """opfuse.compile with the Triton backend over lengths: the shapes captured from the
    export with symbolic sizes render the same @triton.jit functions, and match eager."""
    sources = _kept_sources(monkeypatch)
    with torch.no_grad():
        example = (torch.randn(60, 24), torch.randn(60, 24))
        f = opfuse.compile(_norm_scores, example, options=TRITON)
        for n in (70, 90, 100):
            x, y = torch.randn(n, 24), torch.randn(n, 24)
            torch.testing.assert_close(f(x, y), _norm_scores(x, y), rtol=1e-5, atol=1e-5)
    _check_one_jit_set(sources[1:])  # the first shape compiled statically


def _jit_functions(source: str) -> list[str]:
    """The @triton.jit kernels of a generated module (launchers and helpers left out)."""
    blocks = source.split("@triton.jit\n")[1:]
    return [b.split("\n\n\n")[0] for b in blocks if b.split("(")[0].endswith("_kernel")]
