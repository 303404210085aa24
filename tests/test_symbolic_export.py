"""opfuse.compile over input shapes that vary (frontend/symbolic.py): one export with
symbolic sizes serves every shape it admits, each captured at its sizes, sharing C builds;
shapes it does not admit export on their own. Every result is compared with eager."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export import Dim

import opfuse
from opfuse.bench import models
from tests.conftest import caches_of_the_reference_host, count_compiler_runs


class _Encoder(nn.Module):
    """Token and position embeddings, attention over the sequence, an MLP and LayerNorms:
    rows, row lengths and GEMM M scale with the sequence length."""

    def __init__(self, dim: int = 32, vocab: int = 50, positions: int = 160) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.scale = 1 / math.sqrt(dim)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        q, k, v = self.qkv(h).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) * self.scale
        if mask is not None:
            scores = scores.masked_fill(mask[:, None, :] == 0, -1e4)
        h = self.norm1(h + self.out(torch.softmax(scores, -1) @ v))
        return self.norm2(h + self.down(F.gelu(self.up(h))))


def _ids(batch: int, s: int) -> torch.Tensor:
    return torch.randint(0, 50, (batch, s), generator=torch.Generator().manual_seed(s))


def _counting_exports(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    real = torch.export.export

    def counting(*a: Any, **k: Any) -> Any:
        calls.append(k.get("dynamic_shapes"))
        return real(*a, **k)

    monkeypatch.setattr(torch.export, "export", counting)
    return calls


def test_a_second_length_exports_once_with_symbolic_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second length exports with the length symbolic; later lengths export nothing
    and run no C compiler; each one matches eager and its report says how."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    exports, builds = _counting_exports(monkeypatch), count_compiler_runs(monkeypatch)
    with torch.no_grad():
        fast = opfuse.compile(model, (_ids(2, 24),))
        after: list[tuple[int, int]] = []
        for s in (40, 56, 72, 33, 100):
            x = _ids(2, s)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
            after.append((len(exports), len(builds)))
    assert len(exports) == 2 and exports[0] is None and exports[1] is not None
    assert after[0][0] == after[-1][0] == 2
    assert after[1][1] == after[-1][1], f"a later length ran the C compiler: {after}"
    reports = [e.report for e in fast._entries.values()]  # type: ignore[attr-defined]
    assert not reports[0].dynamic  # the first shape: a static export
    assert all("exported once with symbolic sizes" in r.dynamic[0] for r in reports[1:])
    assert "input 0 dim 1" in reports[1].dynamic[0]
    assert "input 0 dim 0" not in reports[1].dynamic[0]  # the batch never changed


def test_dynamic_shapes_are_symbolic_from_the_first_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With dynamic_shapes, the first compile exports symbolically; sizes in the declared
    range compile even with recompile=False, sizes outside it raise RecompileError."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    exports = _counting_exports(monkeypatch)
    s = Dim("s", min=8, max=128)
    mask = torch.ones(1, 20, dtype=torch.long)
    with torch.no_grad():
        fast = opfuse.compile(
            model,
            (_ids(1, 20),),
            example_kwargs={"mask": mask},
            dynamic_shapes={"ids": {1: s}, "mask": {1: s}},
            recompile=False,
        )
        for n in (20, 64, 9, 128):
            x, m = _ids(1, n), torch.ones(1, n, dtype=torch.long)
            m[0, n // 2 :] = 0
            torch.testing.assert_close(fast(x, mask=m), model(x, mask=m), rtol=1e-4, atol=1e-4)
        assert len(exports) == 1
        with pytest.raises(opfuse.RecompileError, match="shape"):
            fast(_ids(1, 200), mask=torch.ones(1, 200, dtype=torch.long))
        with pytest.raises(opfuse.RecompileError):  # ids and mask must share the length
            fast(_ids(1, 30), mask=torch.ones(1, 31, dtype=torch.long))


def test_lengths_outside_the_exports_range_export_on_their_own() -> None:
    """Length 1 is outside the automatic export's range (0 and 1 are specialised): it
    exports statically and still matches eager, as do the lengths around it."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    with torch.no_grad():
        fast = opfuse.compile(model, (_ids(1, 16),))
        for s in (24, 1, 40, 2):
            x = _ids(1, s)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    notes = [e.report.dynamic for e in fast._entries.values()]  # type: ignore[attr-defined]
    assert [bool(n) for n in notes] == [False, True, False, True, True]


def test_a_second_length_of_one_does_not_make_the_export(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A length of 1 right after the first would export specialised to 1 (0/1
    specialisation), an export every later length is refused by: it compiles on its own,
    and the next length exports with the length symbolic for the ones after it."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    exports = _counting_exports(monkeypatch)
    with torch.no_grad():
        fast = opfuse.compile(model, (_ids(1, 16),))
        counts = []
        for s in (1, 24, 40, 56):
            x = _ids(1, s)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
            counts.append(len(exports))
    assert counts == [2, 3, 3, 3]
    assert exports[1] is None and exports[2] is not None  # length 1: a static export
    assert len(fast._families) == 1  # type: ignore[attr-defined]


def test_a_dim_the_model_fixes_is_reported_as_specialised() -> None:
    """A reshape that needs the width's value keeps it static whatever was asked: explain
    says which sizes are symbolic and which the export fixed."""

    class Heads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = x.shape[0]
            return torch.softmax(x.reshape(b, 4, 8), -1).reshape(b, 32) * 2

    x = torch.randn(6, 32)
    model = Heads().eval()
    report = opfuse.explain(model, (x,), dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO},))
    (note,) = report.dynamic
    assert "input 0 dim 0 = s" in note
    assert "specialised by the export" in note and "input 0 dim 1 stays 32" in note
    fast = opfuse.compile(model, (x,), dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO},))
    for b in (6, 11, 3):
        y = torch.randn(b, 32)
        torch.testing.assert_close(fast(y), model(y))


def test_a_batch_after_lengths_exports_a_second_time() -> None:
    """Lengths first make the length symbolic; a new batch size then exports once more,
    with both symbolic, and later shapes varying either are captured from it."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    with torch.no_grad():
        fast = opfuse.compile(model, (_ids(2, 16),))
        for b, s in ((2, 24), (3, 24), (4, 40), (5, 17)):
            x = _ids(b, s)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    notes = [e.report.dynamic for e in fast._entries.values()]  # type: ignore[attr-defined]
    assert "input 0 dim 0" not in notes[1][0]
    assert all("input 0 dim 0" in n[0] and "input 0 dim 1" in n[0] for n in notes[2:])
    assert fast._exports == 2  # type: ignore[attr-defined]


def test_an_earlier_export_serves_what_the_later_one_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serving at batch 1 after one batch of 2: the second export's symbolic batch starts
    at 2, so new lengths at batch 1 are captured from the first export (batch 1, length
    symbolic), with no third export, no static one and no C build."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    exports, builds = _counting_exports(monkeypatch), count_compiler_runs(monkeypatch)
    with torch.no_grad():
        fast = opfuse.compile(model, (_ids(1, 16),))
        for b, s in ((1, 24), (2, 24), (2, 40)):
            x = _ids(b, s)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
        before = (len(exports), len(builds))
        for s in (56, 40, 33):  # (64 would build: another GEMM tiling regime)
            x = _ids(1, s)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    assert (len(exports), len(builds)) == before == (3, before[1])
    notes = [e.report.dynamic for e in fast._entries.values()]  # type: ignore[attr-defined]
    assert all(n and "input 0 dim 0" not in n[0] for n in notes[-3:])  # the first export's


def test_parameters_changed_after_the_export_are_followed() -> None:
    """The export holds the model's weights: an in-place update compiles every shape
    again from the live values, a replaced parameter exports again."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    with torch.no_grad():
        fast = opfuse.compile(model, (_ids(1, 16),))
        fast(_ids(1, 24))
        model.up.weight.mul_(0.5)
        with pytest.warns(RuntimeWarning, match="compiling again"):
            got = fast(_ids(1, 30))
        torch.testing.assert_close(got, model(_ids(1, 30)), rtol=1e-4, atol=1e-4)
        model.down.weight = nn.Parameter(torch.randn_like(model.down.weight))
        for s in (30, 44):
            torch.testing.assert_close(fast(_ids(1, s)), model(_ids(1, s)), rtol=1e-4, atol=1e-4)


def test_nested_inputs_take_dims_per_leaf() -> None:
    """dynamic_shapes mirrors nested arguments (a dict of tensors)."""

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            a, b = batch["a"], batch["b"]
            return torch.softmax(self.proj(a) + b, -1).sum(1)

    model = Pair().eval()
    n = Dim("n", min=2, max=256)

    def inputs(k: int) -> dict[str, torch.Tensor]:
        return {"a": torch.randn(3, k, 16), "b": torch.randn(3, k, 16)}

    with torch.no_grad():
        fast = opfuse.compile(
            model, (inputs(8),), dynamic_shapes={"batch": {"a": {1: n}, "b": {1: n}}}
        )
        for k in (8, 50, 3):
            x = inputs(k)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    assert all(e.report.dynamic for e in fast._entries.values())  # type: ignore[attr-defined]


def test_malformed_dynamic_shapes_say_what_is_wrong() -> None:
    model = _Encoder().eval()
    with pytest.raises(ValueError, match="not parameters"):
        opfuse.compile(model, (_ids(1, 8),), dynamic_shapes={"tokens": {1: Dim.AUTO}})
    with pytest.raises(TypeError, match="dict, tuple or list"):
        opfuse.compile(model, (_ids(1, 8),), dynamic_shapes=3)


_MODEL = _Encoder().eval()
_FAST: dict[str, Any] = {}


@settings(max_examples=8, deadline=None)
@given(st.integers(2, 150), st.integers(1, 3))
def test_any_admitted_shape_matches_eager(s: int, batch: int) -> None:
    """Random lengths and batch sizes through one compile with both symbolic: every one
    matches eager."""
    if "m" not in _FAST:
        dims = {"ids": {0: Dim.AUTO, 1: Dim.AUTO}}
        with torch.no_grad():
            _FAST["m"] = opfuse.compile(_MODEL, (_ids(2, 12),), dynamic_shapes=dims)
    x = _ids(batch, s)
    with torch.no_grad():
        torch.testing.assert_close(_FAST["m"](x), _MODEL(x), rtol=1e-4, atol=1e-4)


def test_bert_lengths_share_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A BERT-like encoder (attention masked by an input) over lengths: after the second
    length, no export and no C compiler run."""
    torch.manual_seed(0)
    model = models.realistic(models.BertEncoder(layers=2, dim=96, vocab=300)).eval()

    def inputs(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.ones(1, s, dtype=torch.long)
        mask[0, s // 2 :] = 0
        return _ids(1, s) % 300, mask

    caches_of_the_reference_host(monkeypatch)  # all lengths in one tiling regime
    exports, builds = _counting_exports(monkeypatch), count_compiler_runs(monkeypatch)
    counts = []
    with torch.no_grad():
        fast = opfuse.compile(model, inputs(32))
        for s in (40, 56, 72, 100, 33, 120):
            x = inputs(s)
            torch.testing.assert_close(fast(*x), model(*x), rtol=1e-4, atol=1e-4)
            counts.append((len(exports), len(builds)))
    assert counts[0] == counts[-1], counts


def test_a_torch_compile_of_the_same_model_does_not_split_the_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.compile(dynamic=True) and opfuse.compile of one model, at the same lengths:
    their graphs name the length by different symbols, and neither's expressions leak
    into the other's kernels (they would differ from the other lengths' and build)."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    builds = count_compiler_runs(monkeypatch)
    torch._dynamo.reset()
    dyn = torch.compile(model, backend="opfuse", dynamic=True)
    counts = []
    with torch.no_grad():
        once = opfuse.compile(model, (_ids(1, 16),))
        # 32 is also the model's width: the lengths' and the width's 32 print apart
        for s in (16, 24, 32, 56):
            x = _ids(1, s)
            torch.testing.assert_close(dyn(x), model(x), rtol=1e-4, atol=1e-4)
            before = len(builds)
            torch.testing.assert_close(once(x), model(x), rtol=1e-4, atol=1e-4)
            counts.append(len(builds) - before)
    torch._dynamo.reset()
    assert counts[2:] == [0, 0], counts


def test_frozen_weights_pack_once_for_every_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shape compiled from the export packs the frozen weights for opfuse's GEMM
    the same way: one packed copy serves them all (BERT-base: 330 MB a length before)."""
    from opfuse import Options
    from opfuse.backends.c import gemm

    packed: list[tuple[int, int]] = []
    pack = gemm.OwnPack.__call__

    def counting(self: gemm.OwnPack, weight: torch.Tensor) -> torch.Tensor:
        packed.append((self.k, self.n))
        return pack(self, weight)

    monkeypatch.setattr(gemm.OwnPack, "__call__", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 40)).eval()
    opts = Options(implementation="opfuse-gemm")
    with torch.no_grad():
        fast = opfuse.compile(model, (torch.randn(16, 64),), options=opts)
        first = len(packed)
        for rows in (24, 40, 56, 33):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    used = [g.implementation for e in fast._entries.values() for g in e.report.groups]  # type: ignore[attr-defined]
    assert sum(u.startswith("opfuse-gemm") for u in used) == 2 * 5, used
    assert first == 2 and len(packed) == 2, packed


def test_sizes_the_model_returns_are_this_calls() -> None:
    """A model that returns a size (`x.shape[1]`) returns each call's, not the export's
    symbol."""

    class ShapeOut(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
            return x.softmax(-1), x.shape[1], x.shape[0] * x.shape[1]

    m = ShapeOut().eval()
    fast = opfuse.compile(m, (torch.randn(2, 8),))
    for n in (12, 16, 20):
        x = torch.randn(2, n)
        y, width, numel = fast(x)
        assert (width, numel) == (n, 2 * n) and type(width) is int
        torch.testing.assert_close(y, m(x)[0])


def test_dynamic_shapes_by_name_through_args_and_kwargs() -> None:
    """A forward taking *args and **kwargs: dynamic_shapes by parameter name, the
    `*args` entry a sequence and the `**kwargs` one a dict."""

    class Loose(nn.Module):
        def forward(self, *xs: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
            return torch.relu(xs[0] @ xs[1]) + extra["bias"]

    m = Loose().eval()
    rows = Dim("rows", min=2, max=64)

    def inputs(r: int) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        return (torch.randn(r, 8), torch.randn(8, 5)), {"bias": torch.randn(r, 5)}

    args, kwargs = inputs(4)
    spec = {"xs": ({0: rows}, None), "extra": {"bias": {0: rows}}}
    fast = opfuse.compile(m, args, example_kwargs=kwargs, dynamic_shapes=spec)
    for r in (4, 9, 30):
        args, kwargs = inputs(r)
        torch.testing.assert_close(fast(*args, **kwargs), m(*args, **kwargs))
    notes = [e.report.dynamic for e in fast._entries.values()]  # type: ignore[attr-defined]
    assert len(notes) == 3 and all("input 0 dim 0" in n[0] for n in notes)


def test_a_symbolic_graph_that_fails_to_compile_exports_the_shape_on_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should compiling from the export with symbolic sizes fail (ours to get wrong), the
    shape exports statically and compiles: no warning, no torch.compile fallback."""
    import warnings

    from opfuse import compiled
    from opfuse.ir.graph import size_symbols

    real = compiled.compile_graph

    def refusing(graph: Any, *a: Any, **k: Any) -> Any:
        if size_symbols([graph]):
            raise RuntimeError("no symbolic sizes here")
        return real(graph, *a, **k)

    monkeypatch.setattr(compiled, "compile_graph", refusing)
    torch.manual_seed(0)
    model = _Encoder().eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = opfuse.compile(model, (_ids(1, 16),))
        for s in (24, 40):
            x = _ids(1, s)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    entries = list(fast._entries.values())  # type: ignore[attr-defined]
    assert all(e.compiled is not None and not e.report.dynamic for e in entries)


def test_decode_steps_share_an_export_after_the_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt, then steps on a growing cache (another input structure than the
    prompt's): the second step exports with the cache length symbolic, later steps export
    nothing."""

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.proj = nn.Embedding(50, 32), nn.Linear(32, 32)

        def forward(
            self, ids: torch.Tensor, past: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.proj(self.emb(ids))
            keys = h if past is None else torch.cat([past, h], 1)
            weights = torch.softmax(h @ keys.transpose(1, 2), -1)
            return keys, weights @ keys

    torch.manual_seed(0)
    model = Step().eval()
    exports = _counting_exports(monkeypatch)
    with torch.no_grad():
        fast = opfuse.compile(model, (_ids(1, 8),))
        past = torch.randn(1, 8, 32)
        for _ in range(5):
            x = _ids(1, 1)
            keys, out = fast(x, past)
            torch.testing.assert_close((keys, out), model(x, past), rtol=1e-4, atol=1e-4)
            past = keys
    assert len(exports) == 3, exports  # the prompt, the first step, the steps after


def test_a_mostly_static_export_compiles_once_for_every_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPT-2 generation through opfuse.compile: the prompt and the first step compile;
    the second step exports with the cache lengths symbolic, and since most of that
    graph's work has static sizes, its static regions compile once and serve every later
    step (attention over the cache with torch): no compile, no build per token."""
    torch.manual_seed(0)
    model = models.realistic(models.GPT2Decoder(layers=2, dim=96, vocab=100)).eval()
    prompt = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    exports, builds = _counting_exports(monkeypatch), count_compiler_runs(monkeypatch)
    with torch.no_grad():
        expected = models.generate(model, prompt, 12)
        fast = opfuse.compile(model, (prompt,))
        got = models.generate(fast, prompt, 4)
        before = len(builds)
        got = models.generate(fast, prompt, 12)
    assert torch.equal(got, expected)
    assert len(exports) == 3 and len(builds) == before
    assert len(fast._entries) == 2  # type: ignore[attr-defined]
    assert "static regions compiled once serve every shape" in fast.report.dynamic[0]


def test_the_generic_run_follows_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps served by the export's generic compile see an in-place update of a weight,
    and a replaced weight, even once every compiled shape was dropped."""
    torch.manual_seed(0)
    model = models.realistic(models.GPT2Decoder(layers=1, dim=96, vocab=100)).eval()
    prompt = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = opfuse.compile(model, (prompt,))
        torch.testing.assert_close(
            models.generate(fast, prompt, 6), models.generate(model, prompt, 6)
        )
        model.get_parameter("blocks.0.fc.weight").mul_(1.5)
        with pytest.warns(RuntimeWarning, match="compiling again"):
            got = models.generate(fast, prompt, 6)
        torch.testing.assert_close(got, models.generate(model, prompt, 6))
        proj = model.get_submodule("blocks.0.proj")
        proj.weight = nn.Parameter(torch.randn_like(proj.weight))
        torch.testing.assert_close(
            models.generate(fast, prompt, 6), models.generate(model, prompt, 6)
        )
