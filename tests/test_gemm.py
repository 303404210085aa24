"""opfuse's own GEMM ("opfuse-gemm", backends/c/gemm.py): tiles of a blocked GEMM computed
in registers from a weight packed at compile time, the epilogue applied in cache."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import opfuse
from tests.conftest import Fn, assert_matches_eager, assert_no_worse

OWN = opfuse.Options(implementation="opfuse-gemm")


def _compiled(m: nn.Module, *args: torch.Tensor) -> Any:
    fast = opfuse.compile(m.eval(), args, options=OWN)
    used = [g.implementation for g in fast.report.groups if g.pattern != "elementwise"]
    assert any(u.startswith("opfuse-gemm") for u in used), str(fast.report)
    return fast


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 300),
    n=st.integers(1, 90),
    transposed=st.booleans(),
    bias=st.booleans(),
    act=st.sampled_from(["none", "relu", "gelu"]),
    row_gap=st.sampled_from([0, 3]),
)
def test_matches_eager_over_shapes_and_layouts(
    m: int, k: int, n: int, transposed: bool, bias: bool, act: str, row_gap: int
) -> None:
    """Rows and columns that are no multiple of the 6 x 32 register block, K no multiple
    of its 32-product blocks, a Linear's transposed weight or a plain [K, N] one, an input
    whose rows lie further apart than K (a slice)."""
    torch.manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k) / k**0.5 if transposed else torch.randn(k, n) / k**0.5
    b = torch.randn(n) if bias else None
    acts = {"none": lambda t: t, "relu": torch.relu, "gelu": F.gelu}

    def f(x: torch.Tensor) -> torch.Tensor:
        x = x[:, :k]
        y = F.linear(x, w, b) if transposed else x @ w + (b if b is not None else 0)
        return acts[act](y)

    x = torch.randn(m, k + row_gap)
    model = Fn(f)
    fast = _compiled(model, x)
    assert_matches_eager(model, fast(x), (x,))
    x2 = torch.randn(m, k + row_gap)  # the packed weight is the one in the model
    assert_matches_eager(model, fast(x2), (x2,))


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 5),
    m=st.integers(1, 30),
    k=st.integers(1, 100),
    n=st.integers(1, 80),
    transposed=st.booleans(),
    scale=st.booleans(),
)
def test_a_b_the_graph_computes_is_packed_by_the_kernel(
    batch: int, m: int, k: int, n: int, transposed: bool, scale: bool
) -> None:
    """Attention's bmms: B (K^T, a transposed view, or V) comes from the graph, and the
    kernel packs it tile by tile on every call."""
    torch.manual_seed(batch * 10000 + m * 100 + n)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = torch.bmm(a, b.transpose(1, 2) if transposed else b)
        return y * 0.125 if scale else y

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        b = torch.randn(batch, n, k) if transposed else torch.randn(batch, k, n)
        return torch.randn(batch, m, k), b

    model = Fn(f)
    args = inputs()
    fast = _compiled(model, *args)
    for a in (args, inputs()):  # other values, same kernel
        assert_matches_eager(model, fast(*a), a)


@pytest.mark.parametrize(
    "m,k,n", [(64, 1536, 96), (7, 4000, 33), (128, 768, 3072), (9, 1300, 70), (2, 2100, 40)]
)
def test_no_further_from_float64_than_eager(m: int, k: int, n: int) -> None:
    """Long sums: three levels of partial sums keep every chain short."""
    torch.manual_seed(0)
    lin = nn.Linear(k, n)
    x = torch.randn(m, k)
    fast = _compiled(lin, x)
    with torch.no_grad():
        ours, eager = fast(x), lin(x)
        ref64 = lin.double()(x.double())
    assert_no_worse(ours, eager, ref64, f"{m}x{k}x{n}")


def _round32(exact: Fraction) -> np.float32:
    """The float32 nearest `exact`, ties to even (through float64 only where that cannot
    round twice)."""
    f = float(exact)  # correctly rounded to 53 bits
    x = np.float32(f)
    lo, hi = (
        (np.nextafter(x, np.float32(-np.inf)), x)
        if float(x) > f
        else (x, np.nextafter(x, np.float32(np.inf)))
    )
    if float(x) != f and f - float(lo) == float(hi) - f:  # a tie in float64: look again
        return lo if exact < Fraction(f) else hi
    return x


def _documented_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b summed as docs/numerics.md says opfuse's GEMM sums: one fused multiply-add
    chain per 32 consecutive k, those chains added up 8 at a time, then the groups in
    order; every step rounded to float32."""
    m, k = a.shape
    out = np.zeros((m, b.shape[1]), np.float32)
    for i in range(m):
        for j in range(b.shape[1]):
            total, mid = np.float32(0), np.float32(0)
            for k0 in range(0, k, 32):
                acc = np.float32(0)
                for kk in range(k0, min(k0 + 32, k)):  # fma: rounded once
                    acc = _round32(
                        Fraction(float(a[i, kk])) * Fraction(float(b[kk, j])) + Fraction(float(acc))
                    )
                mid = np.float32(mid + acc)
                if (k0 // 32) % 8 == 7 or k0 + 32 >= k:
                    total, mid = np.float32(total + mid), np.float32(0)
            out[i, j] = total
    return out


@pytest.mark.parametrize(
    "m,k,n",
    [
        (7, 300, 33),
        (1, 70, 5),
        (4, 40, 40),
        (20, 300, 70),
        (8, 1100, 24),
        (3, 600, 20),
        (13, 530, 9),
        (5, 700, 64),  # few strips over a long K: a strip of 3 rows and one of 2
        (16, 530, 33),
    ],
)
def test_sums_follow_the_documented_order_bit_for_bit(m: int, k: int, n: int) -> None:
    """Full strips of 6 rows, the last rows (a count of their own; up to 3 of them in one
    pass over a panel), a panel's spare columns, strips that ask the next panel into cache,
    few strips over a long K taken 512 k at a time (the sums kept in the output between
    ranges, the last range shorter than a block; strips of 3 rows without AVX-512): each
    result equals the documented order exactly. (It did not when gcc split the FMA into a
    multiply and an add in a function the strips were inlined into.)"""
    torch.manual_seed(k)
    w, x = torch.randn(k, n), torch.randn(m, k)
    fast = _compiled(Fn(lambda t: t @ w), x)
    want = _documented_sum(x.numpy(), w.numpy())
    assert np.array_equal(fast(x).numpy(), want)


def test_a_frozen_weight_is_prefetched_a_b_the_kernel_packs_is_not() -> None:
    """A weight comes from memory in a model: the GEMM of a frozen one asks its next
    panel into cache; a B the kernel packs on every call (attention's) is in cache."""
    torch.manual_seed(0)
    x = torch.randn(64, 96)
    linear = _compiled(nn.Linear(96, 128), x)
    (src,) = [g.source_code for g in linear.report.groups if "opfuse_gemm_tile" in g.source_code]
    assert "mm, nn, 96, 1);" in src, src
    a, b = torch.randn(2, 64, 96), torch.randn(2, 96, 128)
    bmm = _compiled(Fn(torch.bmm), a, b)
    (src,) = [g.source_code for g in bmm.report.groups if "opfuse_gemm_tile" in g.source_code]
    assert "opfuse_gemm_pack" in src and "mm, nn, 96, 0);" in src, src


def test_nan_and_inf_in_the_input_reach_their_rows_only() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(70, 45)
    x = torch.randn(11, 70)
    x[2, 5], x[9, 69] = float("nan"), float("inf")
    fast = _compiled(lin, x)
    out = fast(x)
    assert_matches_eager(lin, out, (x,))
    finite = torch.ones(11, dtype=torch.bool)
    finite[[2, 9]] = False
    assert torch.isfinite(out[finite]).all() and not torch.isfinite(out[~finite]).any()


def test_the_tuner_weighs_it_against_the_library() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.GELU()).eval()
    x = torch.randn(32, 256)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    (g,) = [g for g in fast.report.groups if g.pattern == "gemm_epilogue"]
    assert "opfuse-gemm" in g.implementation and "blocked" in g.implementation, g.implementation


def test_an_updated_weight_is_packed_again() -> None:
    """The packed panels are a copy: a weight changed in place after compiling must reach
    the result (the compiled module follows its parameters)."""
    torch.manual_seed(0)
    lin = nn.Linear(40, 24).eval()
    x = torch.randn(9, 40)
    fast = _compiled(lin, x)
    assert_matches_eager(lin, fast(x), (x,))
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    with pytest.warns(RuntimeWarning, match="compiling again"):
        out = fast(x)
    assert_matches_eager(lin, out, (x,))


class _WithCache(nn.Module):
    """`body` on a static input, its result appended to a cache whose length is
    symbolic: dynamo's graph has static regions, compiled once with the weights as
    inputs (a graph compiled per size, or a static one, freezes them instead)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        y = self.body(x).flatten(1)
        return torch.cat([cache, y], 0).sum(0)


def _packed_in_regions(body: nn.Module, x: torch.Tensor, monkeypatch: Any) -> tuple[list[Any], Any]:
    from opfuse.runtime import plan

    made: list[Any] = []
    real = plan.Packed
    monkeypatch.setattr(plan, "Packed", lambda *a: made.append(a) or real(*a))
    m = _WithCache(body).eval()
    torch._dynamo.reset()
    f = torch.compile(m, backend="opfuse", options={"implementation": "opfuse-gemm"})
    width = m.body(x).flatten(1).shape[1]

    def run() -> None:
        for rows in (3, 5, 7):  # the second length recompiles with it symbolic
            cache = torch.randn(rows, width)
            assert_matches_eager(m, f(x, cache), (x, cache))

    return made, run


def test_torch_compile_inference_packs_parameters_and_follows_them(monkeypatch: Any) -> None:
    """In the static regions of a torch.compile inference graph with symbolic sizes the
    weights stay graph inputs (test_parameters: a static graph freezes them): opfuse's
    GEMM packs a parameter on the first call and again whenever it changes in place or
    is replaced; after a write no version counter sees, once opfuse.refresh() is
    called."""
    from opfuse.frontend import dynamo

    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 40))
    x = torch.randn(16, 64)
    made, run = _packed_in_regions(body, x, monkeypatch)
    with dynamo.listening() as reports, torch.no_grad():
        run()
        assert any("static regions" in d for r in reports for d in r.dynamic)
        assert made
        body[0].weight.mul_(-1.5)  # in place: its version counter moves
        run()
        body[2].weight.copy_(torch.randn(40, 96))
        run()
        body[2].weight = nn.Parameter(torch.randn(40, 96))  # another tensor
        run()
        body[0].weight.data.mul_(0.5)  # a write no version counter sees
        opfuse.refresh()
        run()
    torch._dynamo.reset()


def test_a_conv_net_under_torch_compile_packs_its_1x1_weights_once(monkeypatch: Any) -> None:
    """The channels-last copy of dynamo's graph keeps what dynamo tells AOTAutograd (the
    inputs' sources), so AOTAutograd still knows the weights for parameters: in the static
    regions of a graph with symbolic sizes a 1x1 convolution run as opfuse's GEMM reads a
    packed copy, as a Linear's does (ResNet-50 b1 through torch.compile, before static
    inference graphs froze their parameters: 37-39 -> 31-32 ms), which follows the
    weight's changes."""
    from opfuse.frontend import dynamo

    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 24, 1))
    x = torch.randn(2, 8, 10, 10)
    made, run = _packed_in_regions(body, x, monkeypatch)
    with torch.no_grad(), dynamo.listening() as reports:
        run()
        assert made and any(r.conv_rows for r in reports)
        body[2].weight.mul_(-2.0)
        run()
    torch._dynamo.reset()


def test_training_graphs_pack_their_weights_on_every_call(monkeypatch: Any) -> None:
    """A training forward's parameters change every step: opfuse's GEMM packs them inside
    the kernel on every call, and no packed copy is kept for the runtime to refresh."""
    from opfuse.frontend import dynamo
    from opfuse.runtime import plan

    kept: list[Any] = []
    monkeypatch.setattr(plan, "Packed", lambda *a: kept.append(a))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8))
    ref = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8))
    ref.load_state_dict(m.state_dict())
    with dynamo.listening() as reports:
        torch._dynamo.reset()
        f = torch.compile(m, backend="opfuse", options={"implementation": "opfuse-gemm"})
        opt, opt_ref = torch.optim.SGD(m.parameters(), 0.1), torch.optim.SGD(ref.parameters(), 0.1)
        for _ in range(3):
            x = torch.randn(8, 32)
            f(x).square().sum().backward()
            ref(x).square().sum().backward()
            opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
        used = [g.implementation for r in reports for g in r.groups]
        assert any(u.startswith("opfuse-gemm") for u in used), used
        assert not kept
    torch._dynamo.reset()


def test_sizes_compiled_apart_share_one_packed_weight(monkeypatch: Any) -> None:
    """A graph compiled once per size (here: rows symbolic, so each size compiles) packs
    each parameter once for all of its sizes, not once per size (BERT-base: 340 MB a
    size), and packs it again once when it changes."""
    from opfuse.backends.c import gemm
    from opfuse.frontend import dynamo

    packed: list[tuple[int, int]] = []
    pack = gemm.OwnPack.__call__

    def counting(self: gemm.OwnPack, weight: torch.Tensor) -> torch.Tensor:
        packed.append((self.k, self.n))
        return pack(self, weight)

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 40)).eval()
    with dynamo.listening() as reports:
        torch._dynamo.reset()
        opts = {"implementation": "opfuse-gemm"}
        f = torch.compile(m, backend="opfuse", dynamic=True, options=opts)
        sizes = (16, 24, 40)
        monkeypatch.setattr(gemm.OwnPack, "__call__", counting)
        with torch.no_grad():
            for rows in sizes:
                x = torch.randn(rows, 64)
                assert_matches_eager(m, f(x), (x,))
            used = [g.implementation for r in reports for g in r.groups]
            assert sum(u.startswith("opfuse-gemm") for u in used) == 2 * len(sizes), used
            assert sorted(packed) == [(64, 96), (96, 40)], packed
            packed.clear()
            m[0].weight.mul_(-1.5)  # each size compiles again, with the weights frozen
            with pytest.warns(RuntimeWarning, match="compiling it again"):
                for rows in sizes:
                    x = torch.randn(rows, 64)
                    assert_matches_eager(m, f(x), (x,))
            assert packed == [(64, 96)], packed
    torch._dynamo.reset()


def test_the_few_rows_long_k_path_is_compiled_only_where_a_tile_may_take_it(
    monkeypatch: Any,
) -> None:
    """A small batch over a long K compiles the ranges (OPFUSE_GEMM_RANGES: 0.75 s of
    gcc); 128 rows (BERT-base's tiles) do not, nor does a K of at most OPFUSE_KC."""
    from opfuse.backends.c import module, own_gemm

    for name, value in (
        ("OPFUSE_KC", own_gemm.OWN_KC),
        ("OPFUSE_MR", own_gemm.OWN_MR),
        ("OPFUSE_PF_MIN", own_gemm.OWN_PF_MIN),
    ):
        assert f"#define {name} {value}" in own_gemm.OWN_GEMM
    headers: list[str] = []
    real = module.build

    def spy(pieces: Any, header: str = "") -> Any:
        headers.append(header)
        return real(pieces, header)

    monkeypatch.setattr(module, "build", spy)
    torch.manual_seed(0)
    for rows, k, want in ((8, 1024, True), (128, 1024, False), (8, 512, False)):
        headers.clear()
        lin, x = nn.Linear(k, 40), torch.randn(rows, k)
        fast = _compiled(lin, x)
        assert any("opfuse_gemm_tile" in h for h in headers)
        assert any(own_gemm.GEMM_RANGES in h for h in headers) is want, (rows, k)
        assert_matches_eager(lin, fast(x), (x,))
