"""Sizes that print as expressions of a graph's size symbols (ir/size.py): a graph with
symbolic sizes compiled per size renders the same C for every size whose decisions come out
alike, so the compiler runs once and the tuner times once."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from opfuse.backends.c import build
from opfuse.bench import models
from opfuse.ir.size import Size, gcd, symbolic_text
from tests.conftest import count_compiler_runs


def _value_of(text: str, values: dict[str, int]) -> int:
    """A Size's C text evaluated with Python's integer semantics for the helpers."""
    env: dict[str, Any] = {
        "opfuse_floordiv": operator.floordiv,
        "opfuse_floormod": operator.mod,
        **values,
    }
    return int(eval(text, env))  # our own expression text


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
    assert int(x) == (_value_of(text, seen) if seen else int(text))


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


def test_c_helpers_divide_as_python_does() -> None:
    """opfuse_floordiv / opfuse_floormod against Python's // and % on every sign."""
    pairs = [(a, b) for a in (-7, -6, -1, 0, 1, 6, 7) for b in (-3, -1, 1, 3)]
    body = "\n".join(
        f"  if (opfuse_floordiv({a}, {b}) != {a // b} || opfuse_floormod({a}, {b}) != {a % b}) "
        "return 1;"
        for a, b in pairs
    )
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


def test_an_encoder_over_lengths_builds_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A BERT-like encoder (attention masked by an input, embeddings of positions) over
    lengths: one compiler run for the lengths past the first two."""
    torch.manual_seed(0)
    model = models.realistic(models.BertEncoder(layers=2, dim=96, vocab=300)).eval()

    def inputs(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(s)
        mask = torch.ones(1, s, dtype=torch.long)
        mask[0, s // 2 :] = 0
        return torch.randint(0, 300, (1, s), generator=g), mask

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
