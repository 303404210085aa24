"""A graph with symbolic sizes compiled once serves every size its decisions hold at
(runtime/sized.py). The suite runs with OPFUSE_CHECK_SERVED=1 (conftest): every served
size is compiled as well, and its source and plan compared with the served ones."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import opfuse
from opfuse.frontend import dynamo
from opfuse.ir.size import Size, deciding, gcd, undecided, value_at
from opfuse.runtime.sized import why_not
from tests.conftest import caches_of_the_reference_host
from tests.test_sizes import _Block, _encoder


def test_decisions_record_comparisons_and_the_values_given_up() -> None:
    s = Size.symbol("s0", 40)
    with deciding() as d:
        rows = s * 768 + 3
        assert rows > 100 and rows != 5
        assert abs(-s) == 40 and abs(-s).text == "(-(-opfuse_s0))"  # keeps the expression
        q, r = divmod(rows, 7)
        assert (q.text, r.text) == (
            "opfuse_floordiv(((opfuse_s0 * 768) + 3), 7)",
            "opfuse_floormod(((opfuse_s0 * 768) + 3), 7)",
        )
        assert gcd(s, 16) == 8 and bool(s)
        assert int(rows // 2) == 15361  # a value given up: that value is decided
        with undecided():
            assert s * 2 < 1000  # (a cost, not recorded)
    assert d.hold({"opfuse_s0": 40})
    assert not d.hold({"opfuse_s0": 56})  # gcd(56, 16) is 16, and int() decided 15361
    assert not d.hold({"opfuse_s1": 40})  # another symbol
    outcomes = {(a, op, b) for a, op, b in d.outcomes}
    assert ("((opfuse_s0 * 768) + 3)", ">", "100") in outcomes
    assert ("opfuse_gcd(opfuse_s0, 16)", "==", "8") in outcomes
    assert ("opfuse_floordiv(((opfuse_s0 * 768) + 3), 2)", "==", "15361") in outcomes
    assert not any("1000" in b for _, _, b in d.outcomes)
    with deciding() as d2:
        assert s < 64 and s % 8 == 0
    assert [v for v in (8, 16, 40, 48, 56) if d2.hold({"opfuse_s0": v})] == [8, 16, 40, 48, 56]
    assert not d2.hold({"opfuse_s0": 64}) and not d2.hold({"opfuse_s0": 41})


def test_torch_compile_dynamic_compiles_an_encoder_once_over_lengths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BERT-like (attention masked by an input, embeddings of positions): the first length
    compiles, the others are served by it, with its library and the plan's sizes
    evaluated at theirs."""
    model, inputs = _encoder()
    caches_of_the_reference_host(monkeypatch)  # all lengths in one tiling regime
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse", dynamic=True)
    before = dynamo.compiles()
    with torch.no_grad(), dynamo.listening() as reports:
        for s in (40, 56, 72, 100, 33, 120, 17):
            x = inputs(s)
            torch.testing.assert_close(f(*x), model(*x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    assert dynamo.compiles() - before == 1
    served = [r for r in reports if any("served by the compile at" in d for d in r.dynamic)]
    assert len(served) == 6


def test_opfuse_compile_serves_lengths_from_its_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """opfuse.compile: the example's shape compiles static, the second length exports with
    the length symbolic and compiles, and later lengths are served by that compile."""
    model, inputs = _encoder()
    caches_of_the_reference_host(monkeypatch)
    with torch.no_grad():
        c = opfuse.compile(model, inputs(16))
        for s in (24, 40, 33, 100, 17):
            x = inputs(s)
            torch.testing.assert_close(c(*x), model(*x), rtol=1e-4, atol=1e-4)
    served = [
        any("served by the compile at" in d for d in e.report.dynamic) for e in c._entries.values()
    ]
    assert served == [False, False, True, True, True, True]
    assert why_not(next(iter(c._entries.values())).compiled) == "its sizes are static"


def test_long_lengths_and_short_serve_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the length a symbol the attention is written out up to 512 tokens (its
    softmax's schedule and the transposes around it deciding nothing on the length), and
    every GEMM splits its rows in tiles of one expression of the length: one compile
    serves 256 to 512 tokens, and 16. (tests/test_attention.py: the fused call's compile,
    from 513 tokens, serving others.)"""
    model, inputs = _encoder()
    caches_of_the_reference_host(monkeypatch)
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse", dynamic=True)
    before = dynamo.compiles()
    with torch.no_grad(), dynamo.listening() as reports:
        for s in (256, 300, 512, 384, 16):
            x = inputs(s)
            torch.testing.assert_close(f(*x), model(*x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    assert dynamo.compiles() - before == 1
    assert not any(r.patterns().get("attention") for r in reports)
    assert sum(any("served by the compile at" in d for d in r.dynamic) for r in reports) == 4


def test_a_size_compiled_again_is_reported_with_the_decision_that_differs() -> None:
    """40 rows and 2 decide otherwise (test below): the compile made at 2 says which
    compiles did not serve it and which of their decisions, taken where, come out
    otherwise there; through both entry points."""
    torch.manual_seed(0)
    model = _Block().eval()
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse", dynamic=True)
    with torch.no_grad(), dynamo.listening() as reports:
        for s in (40, 2):
            x = torch.randn(s, 48)
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    c = opfuse.compile(model, (torch.randn(40, 48),))
    with torch.no_grad():
        for s in (36, 2):  # (the second shape compiles with symbolic sizes)
            x = torch.randn(s, 48)
            torch.testing.assert_close(c(x), model(x), rtol=1e-4, atol=1e-4)
    last = list(c._entries.values())[-1].report  # type: ignore[attr-defined]
    for report, at in ((reports[-1], "=40 would"), (last, "=36 would")):
        why = [d for d in report.dynamic if "would decide otherwise here" in d]
        assert len(why) == 1 and at in why[0], report.dynamic
        assert re.search(r"\(\w+/\w+\.\w+\)$", why[0]), why  # where: (module.function)


def test_a_global_pool_serves_the_batch_sizes_its_schedule_does_not_change_at() -> None:
    """A global pool's rows are short (5x5): its columns schedule never splits them, at
    any batch; the blocks of columns (batch x 4) were compared first, and the compile at
    batch 2 (8 blocks, fewer than 16) did not serve batch 4 (16)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(8, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 2048, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    ).eval()  # fmt: skip
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse", dynamic=True)
    with torch.no_grad(), dynamo.listening() as reports:
        for b in (2, 4, 5):
            x = torch.randn(b, 8, 5, 5)
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    served = [r for r in reports if any(d.startswith("served by the") for d in r.dynamic)]
    assert len(served) == 2, [r.dynamic for r in reports]


def test_a_meta_found_by_trial_runs_serves_only_where_the_op_agrees() -> None:
    """A rewrite's new node: its sizes come from trial runs of the op's meta function, and
    where no expression fits (kron of two [s] vectors: s * s) the value stays. Neither
    decides the symbols' values; a test does, running the meta function where a compile
    would serve."""
    from opfuse.ir.graph import GraphBuilder, TensorMeta
    from opfuse.ir.meta import infer_meta

    aten = torch.ops.aten
    s = Size.symbol("s0", 40)
    b = GraphBuilder()
    x = b.add("input", (), meta=TensorMeta((s, 8), (8, 1), torch.float32))
    v = b.add("input", (), meta=TensorMeta((s,), (1,), torch.float32))
    with deciding() as d:
        rows = infer_meta(aten.view.default, (x, [s * 2, 4]), {})
    assert d.outcomes == {} and len(d.tests) == 1
    assert d.hold({"opfuse_s0": 40}) and d.hold({"opfuse_s0": 977})
    assert value_at(rows.shape[0], {"opfuse_s0": 977}) == 1954
    with deciding() as d:
        kron = infer_meta(aten.kron.default, (v, v), {})
    assert kron.shape == (1600,) and not isinstance(kron.shape[0], Size)
    assert d.hold({"opfuse_s0": 40}) and not d.hold({"opfuse_s0": 41})


class _SizeValued(nn.Module):
    """Numbers computed from a symbolic size: a float (n / 3, a SymFloat), torch.full of
    one, and math.sqrt of one (decomposed to scalar_tensor(n), a constant to fold)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if self.kind == "float":
            return self.lin(x) + n / 3
        if self.kind == "full":
            return self.lin(x) + torch.full((1, n, 1), n * 0.1)
        return (self.lin(x) / math.sqrt(n)).softmax(-1)


@pytest.mark.parametrize("kind", ["float", "full", "sqrt"])
@pytest.mark.parametrize("entry", ["torch.compile", "opfuse.compile"])
def test_a_number_computed_from_a_size_is_served_only_where_it_is_the_same(
    kind: str, entry: str
) -> None:
    """The capture takes such a number as a plain value (recorded in Graph.fixed, a test
    of the sizes), and no constant is folded from a size: a compile serves no size where
    the number differs (each served one had the first size's number: wrong)."""
    torch.manual_seed(0)
    model = _SizeValued(kind).eval()
    torch._dynamo.reset()
    x8 = torch.randn(2, 8, 16)
    if entry == "torch.compile":
        f: Any = torch.compile(model, backend="opfuse", dynamic=True)
    else:
        f = opfuse.compile(model, (x8,))
    with torch.no_grad():
        for n in (8, 12, 20, 12, 7):
            x = x8 if n == 8 else torch.randn(2, n, 16)
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.amax(-1) + x.shape[-1],
        lambda x: (x > 0).sum(-1) * x.shape[-1] - x.shape[0],
        lambda x: torch.where(x > 0, x * 2, x.new_zeros(()) + x.shape[1]).half() * 3,
        lambda x: x + torch.arange(x.shape[1]) * x.shape[1],
    ],
    ids=["float", "int", "half", "positions"],
)
def test_a_size_as_a_scalar_prints_as_its_expression(fn: Any) -> None:
    """A size in a kernel's arithmetic (x + n, a count times n) is a constant that prints
    as its expression, converted to the dtype in C: one compile serves every size (each
    size compiled, its value a literal, before)."""
    torch._dynamo.reset()
    f = torch.compile(fn, backend="opfuse", dynamic=True)
    before = dynamo.compiles()
    with torch.no_grad():
        for n in (9, 12, 20, 33, 17):
            x = torch.randn(5, n)
            torch.testing.assert_close(f(x), fn(x))
    torch._dynamo.reset()
    assert dynamo.compiles() - before == 1


def test_a_full_cache_serves_new_sizes_in_place_of_served_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past cache_limit, a new size that a compile serves takes the place of the size served
    longest ago (served again in milliseconds should it come back), instead of running
    unfused: memory stays bounded, and nothing compiles again."""
    torch._dynamo.reset()
    fn = lambda x: (x * 2).relu().sum(-1)
    f = torch.compile(fn, backend="opfuse", dynamic=True, options={"cache_limit": 3})
    before = dynamo.compiles()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no cache-limit warning
        for n in (*range(2, 12), 3, 2):
            x = torch.randn(n, 8)
            torch.testing.assert_close(f(x), fn(x))
    torch._dynamo.reset()
    assert dynamo.compiles() - before == 1
    model, inputs = _encoder()
    caches_of_the_reference_host(monkeypatch)  # all lengths in one tiling regime
    with torch.no_grad():
        c = opfuse.compile(model, inputs(16), cache_limit=3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for s in (24, 40, 33, 100, 17, 40):
                x = inputs(s)
                torch.testing.assert_close(c(*x), model(*x), rtol=1e-4, atol=1e-4)
    assert len(c._entries) == 3  # the static 16, the compile at 24, one served length


def test_a_size_whose_decisions_differ_compiles_again() -> None:
    """A row of fewer than 8 elements reduces as a pooling window does (schedule._window):
    the softmax over 40 rows and over 2 decide otherwise, and 2 is compiled; 3 is then
    served by it, 36 by the first."""
    torch.manual_seed(0)
    model = _Block().eval()
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse", dynamic=True)
    counts = []
    with torch.no_grad():
        for s in (40, 2, 3, 36):
            x = torch.randn(s, 48)
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
            counts.append(dynamo.compiles())
    torch._dynamo.reset()
    assert [c - counts[0] for c in counts] == [0, 1, 1, 1]


class _ConvNet(nn.Module):
    """Convolutions with oneDNN post-ops: conv + BN + ReLU, a strided conv + SiLU, a
    residual conv + add + ReLU, then a pool and a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.SiLU())
        self.res = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(self.stem(x))
        y = torch.relu(self.res(y) + y)
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize("implementation", ["onednn", "onednn-nhwc"])
def test_library_calls_serve_other_batch_sizes(implementation: str) -> None:
    """oneDNN calls take their sizes at run time and their packed weights serve any batch:
    a compile at batch 2 serves 3 and 5 (equal to eager, NaN kept through ReLU as eager
    keeps it: the finiteness guards), the plan's library calls set up at each."""
    torch.manual_seed(0)
    net = _ConvNet().eval()
    torch._dynamo.reset()
    f = torch.compile(net, backend="opfuse", options={"implementation": implementation})
    with torch.no_grad(), dynamo.listening() as reports:
        f(torch.randn(1, 3, 16, 16))  # (static: dynamo marks the batch dynamic at 2)
        before = dynamo.compiles()
        for b in (2, 3, 5):
            x = torch.randn(b, 3, 16, 16)
            if b == 5:
                x[1, 0, 3, 4] = float("nan")
            y, want = f(x), net(x)
            torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4, equal_nan=True)
            assert torch.equal(y.isnan(), want.isnan())
    torch._dynamo.reset()
    assert dynamo.compiles() - before == 1
    assert sum("served by" in d for r in reports for d in r.dynamic) == 2
    assert any("onednn" in g.implementation for r in reports for g in r.groups)


class _Stride2ThenWinograd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        stem = nn.Conv2d(3, 32, 3, padding=1, stride=2)
        self.stem = nn.Sequential(stem, nn.BatchNorm2d(32), nn.ReLU())
        self.b, self.c = nn.Conv2d(32, 32, 3, padding=1), nn.Conv2d(32, 48, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = torch.relu(self.b(y) + y)
        return torch.relu(self.c(y)).mean((2, 3))


def test_convolutions_as_rows_compile_once_over_batch_and_image_sizes() -> None:
    """Under dynamic=True the batch, height and width are symbolic: a strided stem, then 3x3
    convolutions on opfuse's Winograd kernel (its tiles and bands expressions of the image
    size) compile once and serve every batch and image size after."""
    torch.manual_seed(0)
    net = _Stride2ThenWinograd().eval()
    torch._dynamo.reset()
    options = {"implementation": "opfuse-winograd"}
    f = torch.compile(net, backend="opfuse", dynamic=True, options=options)
    with torch.no_grad(), dynamo.listening() as reports:
        f(torch.randn(1, 3, 32, 32).contiguous(memory_format=torch.channels_last))
        before = dynamo.compiles()
        for b, hw in ((2, 32), (3, 32), (5, 32), (2, 40), (3, 48), (4, 34)):
            x = torch.randn(b, 3, hw, hw).contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(f(x), net(x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    assert dynamo.compiles() - before == 1
    assert sum("served by" in d for r in reports for d in r.dynamic) == 5
    winograd = [g for g in reports[-1].groups if g.implementation.startswith("opfuse-winograd")]
    assert len(winograd) == 2


@pytest.mark.parametrize("implementation", ["onednn", "mkl-unfused", "onednn-kblocks-unfused"])
def test_a_library_linear_serves_other_sizes(implementation: str) -> None:
    """What a library linear reads of the sizes is set up again at the served ones (its
    rows viewed back as batch x tokens); MKL's and oneDNN's packed weights serve any
    rows."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 40).eval()  # (K over one block: lower/groups.K_BLOCK)
    fn: Any = lambda x: torch.relu(lin(x))
    torch._dynamo.reset()
    options = {"implementation": implementation}
    f = torch.compile(fn, backend="opfuse", dynamic=True, options=options)
    before, precision = dynamo.compiles(), torch.get_float32_matmul_precision()
    if implementation == "onednn":
        torch.set_float32_matmul_precision("high")  # (oneDNN's one-call GEMM is allowed)
    try:
        with torch.no_grad(), dynamo.listening() as reports:
            for b, t in ((2, 7), (3, 7), (4, 11)):
                x = torch.randn(b, t, 96)
                torch.testing.assert_close(f(x), fn(x), rtol=1e-4, atol=1e-4)
    finally:
        torch.set_float32_matmul_precision(precision)
    torch._dynamo.reset()
    assert dynamo.compiles() - before == 1
    kind = implementation.removesuffix("-unfused")
    assert all(g.implementation.startswith(kind) for r in reports for g in r.groups[:1])


@pytest.mark.parametrize("epilogue", ["gelu", "residual", "none", "narrow"])
def test_blocked_gemms_serve_every_row_count_with_tiles_they_take_as_they_run(
    epilogue: str,
) -> None:
    """The blocked GEMMs at a symbolic row count take their tiles as the kernel runs: one
    compile over 2-1100 rows, where a static compile splits rows from 256. opfuse's GEMM
    tiles rows or columns (gemm_tiles.own_tiles); MKL's, its packed weight laid out per
    column tile, keeps one column split and tiles the rows (a narrow weight, one column
    tile: rows in whole rounds of the threads). (Each served size is also compiled and
    compared with it: OPFUSE_CHECK_SERVED.)"""
    torch.manual_seed(0)
    lin, narrow = nn.Linear(64, 96).eval(), nn.Linear(64, 40).eval()
    fns: dict[str, Any] = {
        "gelu": lambda x: torch.nn.functional.gelu(lin(x)),
        "residual": lambda x: lin(x) + x.repeat(1, 2)[:, :96],
        "none": lambda x: lin(x),
        "narrow": lambda x: torch.relu(narrow(x)),
    }
    fn = fns[epilogue]
    for implementation in ("opfuse-gemm", "blocked"):
        torch._dynamo.reset()
        options = {"implementation": implementation}
        f = torch.compile(fn, backend="opfuse", dynamic=True, options=options)
        before = dynamo.compiles()
        with torch.no_grad(), dynamo.listening() as reports:
            for m in (16, 300, 100, 512, 255, 256, 2, 9, 1100):
                x = torch.randn(m, 64)
                torch.testing.assert_close(f(x), fn(x), rtol=1e-4, atol=1e-4)
        torch._dynamo.reset()
        assert dynamo.compiles() - before == 1, implementation
        assert all(g.implementation.startswith(implementation) for r in reports for g in r.groups)


_KINDS = {
    "elementwise": lambda x: ((x * 2).relu() + 1).sigmoid() * x,
    "reduction": lambda x: torch.softmax(x, -1) + torch.nn.functional.layer_norm(x, x.shape[-1:]),
    "rows": lambda x: x.sum(0) + x.amax(0) * x.mean(0),
}


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from([*sorted(_KINDS), "epilogue"]),
    st.lists(st.integers(2, 300), min_size=3, max_size=5, unique=True),
    st.integers(3, 70),
)
def test_served_sizes_match_eager_and_their_own_compile(
    kind: str, sizes: list[int], width: int
) -> None:
    """Elementwise, reduction and GEMM epilogue groups over random sizes under
    torch.compile(dynamic=True): each matches eager; a size served by an earlier compile
    is also compiled and compared with it (OPFUSE_CHECK_SERVED); no more compiles than
    sizes."""
    torch.manual_seed(0)
    if kind == "epilogue":
        lin = nn.Linear(width, 24).eval()
        fn: Any = lambda x: torch.nn.functional.gelu(lin(x)) + x[:, :1]
    else:
        fn = _KINDS[kind]
    torch._dynamo.reset()
    f = torch.compile(fn, backend="opfuse", dynamic=True)
    before = dynamo.compiles()
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, width)
            torch.testing.assert_close(f(x), fn(x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    assert dynamo.compiles() - before <= len(sizes)


def test_a_served_size_follows_a_parameter_changed_since() -> None:
    """Under torch.compile's no_grad graphs the parameters are compiled in as constants: a
    weight changed in place after a size served others is seen by the sizes served before
    and by a new size, which is compiled again rather than served from the old weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse", dynamic=True)
    with torch.no_grad():
        for n in (20, 30):
            x = torch.randn(n, 16)
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
        model[0].weight.mul_(2)
        with pytest.warns(RuntimeWarning, match="compiling it again"):
            for n in (40, 30, 20):
                x = torch.randn(n, 16)
                torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
