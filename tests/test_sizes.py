"""Sizes that print as expressions of a graph's size symbols (ir/size.py): a graph with
symbolic sizes compiled per size renders the same C for every size whose decisions come out
alike, so the compiler runs once and the tuner times once."""

from __future__ import annotations

import math
import operator
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from opfuse.backends.c import build
from opfuse.bench import models
from opfuse.ir.size import (
    Size,
    at_least,
    bindings,
    deciding,
    either,
    gcd,
    readable,
    symbolic_text,
    unhoisted,
    value_at,
)
from tests.conftest import assert_matches_eager, caches_of_the_reference_host, count_compiler_runs

OPS = [operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 5000),
    st.integers(2, 5000),
    st.lists(
        st.tuples(st.sampled_from(range(len(OPS))), st.integers(-40, 40), st.booleans()),
        max_size=8,
    ),
)
def test_arithmetic_keeps_an_expression_of_the_value(
    s0: int, s1: int, steps: list[tuple[int, int, bool]]
) -> None:
    """Whatever arithmetic runs on Sizes, the text evaluates to the value."""
    a, b = Size.symbol("s0", s0), Size.symbol("s1", s1)
    x: Any = a
    for op, k, swap in steps:
        fn = OPS[op]
        other: Any = b if k == 0 else k
        if fn in (operator.floordiv, operator.mod) and (swap or other == 0):
            continue  # only divisions by what is not zero
        x = fn(other, x) if swap else fn(x, other)
    with symbolic_text() as seen:
        text = str(x)
    assert int(x) == (value_at(x, seen) if seen else int(text))
    # and at other values of the symbols, as Python computes it (a plain int only where
    # the result is the same at every size: x * 0, not (s0 // 64) * 64 at s0 < 64)
    for d0, d1 in ((3, 5), (7, -1), (100, 3000)):
        moved = {"opfuse_s0": s0 + d0, "opfuse_s1": s1 + d1}
        assert value_at(x, moved) == _replay(s0 + d0, s1 + d1, steps)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 3000),
    st.integers(1, 600),
    st.integers(1, 64),
    st.lists(st.sampled_from(["ceil", "either", "mod", "sub"]), max_size=5),
)
def test_a_decision_reads_as_what_it_computes(
    s0: int, bound: int, k: int, steps: list[str]
) -> None:
    """readable (the report's form of a decision) shows at_least and either as a
    comparison and a conditional, -(-a // b) as ceil(a / b): evaluated, it is the value
    of the expression at other values of the symbol."""
    a = Size.symbol("s0", s0)
    x: Any = a
    for step in steps:
        if step == "ceil":
            x = -(-x // k)
        elif step == "either":
            x = either(at_least(a, bound), x, a + k)
        elif step == "mod":
            x = x % k + x // k
        else:
            x = x - k
    if not isinstance(x, Size):
        return
    shown = readable(x.text)
    assert "floordiv" not in shown and "opfuse_" not in shown, shown
    if "either" in steps:
        assert f"if s0 >= {bound} else" in shown, shown
    for other in (1, s0 + 7, 4000):
        at = {"opfuse_s0": other}
        assert eval(shown, {"ceil": math.ceil}, {"s0": other}) == value_at(x, at), shown


def test_a_size_that_is_zero_at_this_size_keeps_its_expression_in_a_product() -> None:
    s = Size.symbol("s0", 10)
    for x in ((s // 64) * 64, 64 * (s // 64), (s // 64) * (s // 64)):
        assert isinstance(x, Size) and value_at(x, {"opfuse_s0": 130}) in (128, 4)
    assert (s * 0, 0 * s) == (0, 0) and not isinstance(s * 0, Size)


def _replay(s0: int, s1: int, steps: list[tuple[int, int, bool]]) -> int:
    """The steps the test applies, on plain ints (no step divides by zero: a divisor is
    s1 >= 1 or a nonzero k, and a swapped division is skipped)."""
    x = s0
    for op, k, swap in steps:
        fn = OPS[op]
        other = s1 if k == 0 else k
        if fn in (operator.floordiv, operator.mod) and swap:
            continue
        x = fn(other, x) if swap else fn(x, other)
    return x


def test_printing_outside_rendering_shows_the_value() -> None:
    s = Size.symbol("s0", 32)
    n = s * 768
    assert (str(n), f"{n}", repr((n, 1)), f"{n:5d}") == ("24576", "24576", "(24576, 1)", "24576")
    with symbolic_text() as seen:
        assert (str(n), f"{n:5d}") == ("(opfuse_s0 * 768)", "24576")
    assert seen == {"opfuse_s0": 32}
    assert gcd(768, s) is s and not isinstance(gcd(100, s), Size)  # 32 itself, then 4
    with symbolic_text() as seen:  # a Size of another size: one value per symbol
        assert (str(s), str(Size.symbol("s0", 64) + 1)) == ("opfuse_s0", "65")
    assert seen == {"opfuse_s0": 32}
    assert n == 24576 and hash(n) == hash(24576) and {24576: 1}[n] == 1


def test_hoisted_expressions_print_as_locals_bound_once() -> None:
    """With hoist=True an expression prints as a local's name (a symbol as itself); the
    declarations bind those a text uses, and a comment can show the expressions again."""
    s = Size.symbol("s0", 32)
    n, m = (s + 1) // 2, s * 3
    with symbolic_text(hoist=True) as seen:
        assert (str(n), str(s), str(n), str(m)) == (
            "opfuse__h0",
            "opfuse_s0",
            "opfuse__h0",
            "opfuse__h1",
        )
    assert seen == {"opfuse_s0": 32}
    assert bindings(seen, "x[opfuse__h1]") == "\n  const int64_t opfuse__h1 = (opfuse_s0 * 3);"
    assert (
        unhoisted(seen, "/* opfuse__h0 bytes */")
        == "/* opfuse_floordiv((opfuse_s0 + 1), 2) bytes */"
    )


def test_a_decision_names_where_it_was_taken() -> None:
    """The decisions that come out otherwise at other values, each with the function that
    took it: the report says why a size compiled again."""
    s = Size.symbol("s0", 10)
    with deciding() as d:
        assert s < 256 and s * 2 == 20 and s + 1 > 3
    assert d.otherwise({"opfuse_s0": 12}) == [
        "`s0 * 2 == 20` (tests/test_sizes.test_a_decision_names_where_it_was_taken)"
    ]
    assert len(d.otherwise({"opfuse_s0": 300})) == 2 and not d.otherwise({"opfuse_s0": 10})


def test_c_helpers_divide_as_python_does() -> None:
    """opfuse_floordiv / opfuse_floormod against Python's // and % on every sign."""
    pairs = [(a, b) for a in (-7, -6, -1, 0, 1, 6, 7) for b in (-3, -1, 1, 3)]
    body = "\n".join(
        f"  if (opfuse_floordiv({a}, {b}) != {a // b} || opfuse_floormod({a}, {b}) != {a % b}) "
        "return 1;"
        for a, b in pairs
    )
    # (a zero divisor gives 0: an expression hoisted out of a loop that runs no iteration)
    body += "\n  if (opfuse_floordiv(5, 0) != 0 || opfuse_floormod(5, 0) != 0) return 2;"
    lib = build.build([f"int probe(void *const *args, int nthreads) {{\n{body}\n  return 0;\n}}\n"])
    assert lib.fn("probe")(None, 1) == 0


def _timed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from opfuse import autotune

    timed: list[str] = []
    real = autotune.choose

    def counting(graph: Any, group: Any, *a: Any, **k: Any) -> Any:
        timed.append(group.pattern)
        return real(graph, group, *a, **k)

    monkeypatch.setattr(autotune, "choose", counting)
    return timed


class _Block(nn.Module):
    """LayerNorm(x + MLP(x)) and a softmax over the rows' own length: sizes that scale with
    the symbol in rows, in columns and in both."""

    def __init__(self, dim: int = 48) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))
        scores = torch.softmax(h @ h.transpose(-1, -2) * 0.125, -1)
        return scores @ h + h.sum(0, keepdim=True).tanh()


def _run_sizes(model: nn.Module, inputs: Any, sizes: list[int]) -> None:
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse", dynamic=True, options={"cache_limit": 64})
    with torch.no_grad():
        for s in sizes:
            x = inputs(s)
            torch.testing.assert_close(f(*x), model(*x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(65, 128), min_size=4, max_size=6, unique=True))
def test_every_size_matches_eager_and_the_kernels_build_once(sizes: list[int]) -> None:
    """Rows, row lengths and GEMM M symbolic: each size compiles (per size), all of them
    match eager, and past the first size the C compiler never runs again: these sizes
    share every decision that depends on a size (the scores' GEMM takes column tiles of 64
    from 65 columns on, a sum over more than 16 rows runs in float64), but the runtime's
    parallel one, which the kernels take as they run."""
    with pytest.MonkeyPatch.context() as mp:
        runs, timed = count_compiler_runs(mp), _timed(mp)
        torch.manual_seed(0)
        model = _Block().eval()
        _run_sizes(model, lambda s: (torch.randn(s, 48),), sizes[:1])
        first_runs, first_timed = len(runs), len(timed)
        _run_sizes(model, lambda s: (torch.randn(s, 48),), sizes)
    assert len(runs) == first_runs, "a later size ran the C compiler"
    assert len(timed) == first_timed, "a later size timed candidates"


def _encoder() -> tuple[nn.Module, Any]:
    """A BERT-like encoder (attention masked by an input, embeddings of positions) and its
    inputs at a length."""
    torch.manual_seed(0)
    model = models.realistic(models.BertEncoder(layers=2, dim=96, vocab=300)).eval()

    def inputs(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(s)
        mask = torch.ones(1, s, dtype=torch.long)
        mask[0, s // 2 :] = 0
        return torch.randint(0, 300, (1, s), generator=g), mask

    return model, inputs


def test_an_encoder_over_lengths_builds_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A BERT-like encoder over lengths: one compiler run for the lengths past the first
    two."""
    model, inputs = _encoder()
    caches_of_the_reference_host(monkeypatch)  # all lengths in one tiling regime
    runs = count_compiler_runs(monkeypatch)
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse", dynamic=True, options={"cache_limit": 64})
    counts = []
    with torch.no_grad():
        for s in (40, 56, 72, 100, 33, 120):
            x = inputs(s)
            torch.testing.assert_close(f(*x), model(*x), rtol=1e-4, atol=1e-4)
            counts.append(len(runs))
    torch._dynamo.reset()
    assert counts[1] == counts[-1], counts


def test_a_rewritten_op_keeps_the_sizes_its_inputs_give_it() -> None:
    """infer_meta (a rewrite's new node) puts a Size wherever trial runs at other symbol
    values show the result follows one: the batch of a convolution, the rows of a
    flattening view; never where the value merely coincides (16 channels at batch 16), and
    two symbols equal at this size stay apart."""
    from opfuse.ir.graph import GraphBuilder, TensorMeta
    from opfuse.ir.meta import infer_meta

    aten = torch.ops.aten
    n, h = Size.symbol("s0", 16), Size.symbol("s1", 16)
    b = GraphBuilder()
    x = b.add("input", (), meta=TensorMeta((n, 16, h, 8), (16 * h * 8, h * 8, 8, 1), torch.float32))
    w = b.add("input", (), meta=TensorMeta((16, 16, 3, 3), (144, 9, 3, 1), torch.float32))
    conv = infer_meta(
        aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}
    )
    assert conv.shape == (16, 16, 16, 8)
    assert [type(s) is Size for s in conv.shape] == [True, False, True, False]
    with symbolic_text():
        assert (str(conv.shape[0]), str(conv.shape[2])) == ("opfuse_s0", "opfuse_s1")
        assert "opfuse_s1" in str(conv.stride[0])
    assert value_at(conv.stride[0], {"opfuse_s1": 5}) == 16 * 5 * 8
    rows = infer_meta(aten.view.default, (x, [n * 16 * h, 8]), {})
    assert isinstance(rows.shape[0], Size) and value_at(rows.shape[0], {"opfuse_s0": 3}) == 768
    flat = infer_meta(aten.view.default, (x, [-1]), {})  # s0 * 16 * s1 * 8: no known Size
    assert flat.shape == (16 * 16 * 16 * 8,) and not isinstance(flat.shape[0], Size)


@pytest.mark.parametrize("h", [16, 17, 112])
def test_a_strided_window_keeps_its_positions_as_an_expression(h: int) -> None:
    """A stride-2 convolution's or pool's output height, (H + 2p - k) // s + 1, is no
    known Size times or over an int: it is found as a floor division of H."""
    from opfuse.ir.graph import GraphBuilder, TensorMeta
    from opfuse.ir.meta import infer_meta

    aten = torch.ops.aten
    n, hs = Size.symbol("s0", 2), Size.symbol("s1", h)
    b = GraphBuilder()
    x = b.add(
        "input", (), meta=TensorMeta((n, 8, hs, hs), (8 * hs * hs, hs * hs, hs, 1), torch.float32)
    )
    w = b.add("input", (), meta=TensorMeta((8, 8, 3, 3), (72, 9, 3, 1), torch.float32))
    conv = infer_meta(
        aten.convolution.default, (x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1), {}
    )
    pool = infer_meta(aten.max_pool2d.default, (x, [3, 3], [2, 2], [0, 0], [1, 1], True), {})
    for m, at in ((conv, lambda v: (v + 2 - 3) // 2 + 1), (pool, lambda v: -(-(v - 3) // 2) + 1)):
        assert isinstance(m.shape[2], Size) and isinstance(m.shape[3], Size)
        for v in (h, 31, 224, 9):
            assert value_at(m.shape[2], {"opfuse_s1": v}) == at(v)


def test_expressions_the_trials_cannot_tell_apart_are_tried_where_they_differ() -> None:
    """Sizes derived from the symbols (X = 1 + (s - 1) // 16) move little in the trials:
    X // 2 + 1 passes for (X + 1) // 2 while X stays odd, and a square image's H-derived
    size passes for the W-derived one. Each size then printed its own expression."""
    from opfuse.ir.graph import GraphBuilder, TensorMeta
    from opfuse.ir.meta import infer_meta

    aten = torch.ops.aten
    sh, sw = Size.symbol("s63", 168), Size.symbol("s59", 168)
    h, w = 1 + (sh - 1) // 16, 1 + (sw - 1) // 16  # 11 and 11: odd
    b = GraphBuilder()
    x = b.add("input", (), meta=TensorMeta((2, 8, h, w), (8 * h * w, h * w, w, 1), torch.float32))
    pool = infer_meta(aten.max_pool2d.default, (x, [3, 3], [2, 2], [1, 1], [1, 1], False), {})
    for at_h, at_w in ((168, 168), (184, 168), (168, 184), (200, 232), (17, 1000)):
        want = [(1 + (v - 1) // 16 + 1) // 2 for v in (at_h, at_w)]
        values = {"opfuse_s63": at_h, "opfuse_s59": at_w}
        assert [value_at(d, values) for d in pool.shape[2:]] == want, (at_h, at_w)


class _ConvNet(nn.Module):
    def __init__(self, depthwise: bool) -> None:
        super().__init__()
        mid = nn.Conv2d(16, 16, 3, padding=1, groups=16 if depthwise else 1)
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            mid, nn.ReLU(), nn.Conv2d(16, 32, 1),
        )  # fmt: skip
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def test_a_conv_net_over_batch_sizes_builds_per_size_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """opfuse.compile over batch sizes: past the export with the batch symbolic, sizes of
    one range share the C build, through BatchNorm folding, channels-last and the 1x1
    convolution's GEMM tiles and opfuse's depthwise kernel (its geometry and tiles
    expressions of the batch)."""
    import opfuse

    for depthwise in (False, True):
        torch.manual_seed(0)
        model = _ConvNet(depthwise).eval()
        f = opfuse.compile(model, (torch.randn(2, 3, 16, 16),))
        runs = count_compiler_runs(monkeypatch)
        counts = []
        with torch.no_grad():
            for b in (3, 5, 6, 7):
                x = torch.randn(b, 3, 16, 16)
                torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
                counts.append(len(runs))
        assert counts[0] == counts[-1], counts
        if depthwise:
            last = list(f._entries.values())[-1]
            assert last.compiled is not None
            used = [g.implementation for g in last.compiled.report.groups]
            assert any("opfuse-dw" in u.split(" ")[0] for u in used), used


def _strided_net() -> nn.Module:
    """Strided convolutions, a depthwise one, a padded max pool and a global mean: every
    size after the stem an expression of the image's height and width."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU6(),
        nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.ReLU6(), nn.Conv2d(16, 32, 1),
        nn.MaxPool2d(3, 2, 1), nn.Conv2d(32, 32, 3, 2, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    ).eval()  # fmt: skip


def test_a_strided_conv_net_over_image_sizes_compiles_from_one_export(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """New image heights and widths are captured from the export with them symbolic and
    share its build. A strided convolution's relayout tried a Size of value 0 (an offset)
    as a divisor (ZeroDivisionError), and every new size then exported and compiled on
    its own."""
    import opfuse
    from opfuse import compiled

    model = _strided_net()
    failed: list[str] = []
    monkeypatch.setattr(compiled.log, "debug", lambda msg, *a: failed.append(msg % a))
    runs = count_compiler_runs(monkeypatch)
    counts = []
    with torch.no_grad():
        f = opfuse.compile(model, (torch.randn(2, 3, 32, 32),))
        for s in (40, 48, 56, 64):
            x = torch.randn(2, 3, s, s)
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
            counts.append(len(runs))
    assert not failed, failed
    # past the export, one build: strided windows' sizes, a padded pool's and a mean's
    # count of elements print as expressions of H and W
    assert counts[1] == counts[-1], counts
    assert f._exports == 1  # type: ignore[attr-defined]
    reports = [e.report for e in f._entries.values()]  # type: ignore[attr-defined]
    assert all(r.dynamic for r in reports[1:])


def test_torch_compile_dynamic_fuses_a_strided_conv_net_over_image_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dynamic=True makes H and W symbolic: the graph compiled (it fell back to torch
    whole on the relayout's ZeroDivisionError) and every later image size shares its
    build."""
    model = _strided_net()
    runs = count_compiler_runs(monkeypatch)
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse", dynamic=True)
    counts = []
    with torch.no_grad():
        for s in (40, 48, 56, 64):
            x = torch.randn(2, 3, s, s)
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
            counts.append(len(runs))
    torch._dynamo.reset()
    assert counts[0] >= 1 and counts[0] == counts[-1], counts


def test_a_pool_over_symbolic_image_sizes_computes_no_size_in_its_loops(
    tmp_path: Any,
) -> None:
    """A stem's max pool under dynamic=True reads the conv's rows through a pad and two
    unfolds: its index held nested floor divisions of H and W, computed per element (a
    ResNet-50's stem pool 8x slower than at static sizes). Each kernel binds its size
    expressions once, on entry."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1), nn.Conv2d(16, 8, 1),
    ).eval()  # fmt: skip
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse", dynamic=True, options={"debug_dir": str(tmp_path)})
    with torch.no_grad():
        for b, s in ((2, 40), (3, 56), (2, 33)):
            x = torch.randn(b, 3, s, s)
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    sources = [p.read_text() for p in tmp_path.rglob("source.c")]
    assert sources
    pools = 0
    for text in sources:
        for body in text.split("(void *const *args, int nthreads) {")[1:]:
            body = body.split("\n}\n")[0]
            pools += "op_max_float" in body and "opfuse__h" in body
            loops = [ln for ln in body.splitlines() if "const int64_t opfuse_" not in ln]
            assert not [ln for ln in loops if "opfuse_floordiv" in ln], body
    assert pools >= 1


def test_gemm_tiles_print_one_expression_per_size_range() -> None:
    """The tile of rows is a closed form of M (ir/size.py prints it): every M of a regime
    gets the same text, where halving until the tile fit printed a step per doubling."""
    from opfuse.lower import gemm_tiles

    texts = set()
    for m in (9000, 14000, 30000, 61000):
        spec = _FakeSpec(Size.symbol("s0", m // 8) * 8, 384)
        tm, tn = gemm_tiles.tiles(spec, threads=2)  # type: ignore[arg-type]
        assert tm * tn <= gemm_tiles.TILE_MAX_ELEMENTS and tm % 16 == 0
        with symbolic_text():
            texts.add(str(tm))
    assert len(texts) == 1, texts


class _FakeSpec:
    def __init__(self, m: int, n: int) -> None:
        self.m, self.n, self.batch = m, n, 1


def test_a_kernel_comment_prints_no_size_specific_count() -> None:
    """A byte count that is no Size, in a kernel with symbolic sizes, is this size's value:
    printed in the kernel's comment it made each size's source, and build, its own."""
    from types import SimpleNamespace

    from opfuse.backends.common import traffic

    s = Size.symbol("s0", 6)
    k = SimpleNamespace(
        outer=(SimpleNamespace(extent=s),),
        buffers=(SimpleNamespace(nbytes=s * 4), SimpleNamespace(nbytes=96)),
        bytes_read=96,
        bytes_written=s * 4,
    )
    with symbolic_text():
        assert traffic(k) == "writes (opfuse_s0 * 4) bytes"  # type: ignore[arg-type]
    static = SimpleNamespace(
        outer=(SimpleNamespace(extent=6),),
        buffers=(SimpleNamespace(nbytes=24), SimpleNamespace(nbytes=96)),
        bytes_read=96,
        bytes_written=24,
    )
    assert traffic(static) == "reads 96 bytes, writes 24 bytes"  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_size_as_a_low_precision_value_converts_as_a_cast_from_int64(
    dtype: torch.dtype,
) -> None:
    """Sizes in the arithmetic of a float16/bfloat16 tensor, as scalars and as fills (the
    sizes symbolic; 2049 rows: no float16 holds it): no further from float64 than eager
    at every size the compile serves."""
    from opfuse.frontend import dynamo

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * x.shape[0] + x.shape[1] + torch.full_like(x, x.shape[0] * 3) * x

    torch._dynamo.reset()
    f = torch.compile(scaled, backend="opfuse", dynamic=True)
    before = dynamo.compiles()
    for rows in (5, 9, 300, 2049):
        x = torch.randn(rows, 7).to(dtype)
        assert_matches_eager(scaled, f(x), (x,))
    torch._dynamo.reset()
    assert dynamo.compiles() - before == 1
