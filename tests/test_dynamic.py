"""Graphs with symbolic sizes (frontend/dynamic.py): compiled once for every size where most
of the work has static sizes, per size (up to the cache limit) where it does not."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from opfuse.bench import models
from opfuse.frontend import dynamic, dynamo
from opfuse.report.tables import FusionReport, notes


def _decoder() -> nn.Module:
    torch.manual_seed(0)
    return models.realistic(models.GPT2Decoder(layers=2, dim=96, vocab=211))


def test_generation_compiles_three_graphs_then_none(caplog: pytest.LogCaptureFixture) -> None:
    """A prompt, the first step on the cache, then the cache length symbolic: no compile
    for any later length, and every step's logits match eager's."""
    model = _decoder()
    torch._dynamo.reset()
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(1)
        return dynamo.opfuse_backend(gm, example_inputs)

    step = torch.compile(model, backend=counting)
    prompt = torch.randint(0, 211, (1, 7), generator=torch.Generator().manual_seed(1))
    counts = []
    before = dynamo.compiles()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="opfuse"):
        want, got = model(prompt), step(prompt)
        for _ in range(12):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            nxt = want[0][:, -1].argmax(-1, keepdim=True)  # eager's token for both
            want, got = model(nxt, *want[1:]), step(nxt, *got[1:])
            counts.append(dynamo.compiles())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(graphs) == 3
    # the symbolic graph compiled at step 3 (its static regions together), then nothing
    assert counts[2] == counts[-1] == before + 3
    assert any(
        "symbolic sizes" in r.message and "static regions" in r.message for r in caplog.records
    )
    torch._dynamo.reset()


class _Mixed(nn.Module):
    """Static work on the parameters and a static side input, a symbolic batch in the
    middle: the regions take a value computed from the symbolic input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) * 0.3)
        self.b = nn.Parameter(torch.randn(16) * 0.1)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.softmax(self.norm(y @ self.w + self.b).relu() * 2, -1)  # [4, 16] static
        s = x.sum(0)  # [16] from a symbolic [n, 16]
        c = torch.tanh(a * s + a.mean(0)).exp() - 1  # static again
        return c, x * c.sum(0)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(2, 40), min_size=3, max_size=6, unique=True))
def test_symbolic_batch_matches_eager_and_compiles_once(sizes: list[int]) -> None:
    """Dynamo's automatic dynamic: the first size compiles a static graph, the second one
    with the batch symbolic (`dynamic=True` would make y's sizes symbolic too), then no
    size compiles anything."""
    torch.manual_seed(0)
    seen = _symbolic_calls(_Mixed().eval(), tuple(sizes))
    assert seen[1] == seen[-1]  # the symbolic graph's one compile served every later size


class _Chain(_Mixed):
    """Two static regions, the second waiting on a symbolic value computed from the first."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, d = super().forward(x, y)
        return torch.tanh(c * d.sum(0)).sigmoid() + self.b, d


def _symbolic_calls(model: nn.Module, sizes: tuple[int, ...]) -> list[int]:
    """Run `model` compiled by opfuse on batches of `sizes` (the second one makes the batch
    symbolic), checking each against eager; the compile count after each call."""
    y = torch.randn(4, 16)
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse")
    seen = []
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, 16)
            torch.testing.assert_close(f(x, y), model(x, y), rtol=1e-5, atol=1e-5)
            seen.append(dynamo.compiles())
    torch._dynamo.reset()
    return seen


def test_static_regions_build_as_one_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """The symbolic graph's regions (before and after the symbolic reduction) are one
    compile: one compiler run for both, one count."""
    from opfuse.backends.c import module

    torch.manual_seed(0)
    model = _Chain().eval()
    builds: list[int] = []
    real = module.build

    def counting(pieces: Any, header: str = "") -> Any:
        builds.append(len(pieces))
        return real(pieces, header)

    monkeypatch.setattr(module, "build", counting)
    splits: list[dynamic.Split] = []
    real_split = dynamo.split_static

    def split(gm: torch.fx.GraphModule, static: Any = ()) -> dynamic.Split:
        splits.append(real_split(gm, static))
        return splits[-1]

    monkeypatch.setattr(dynamo, "split_static", split)
    seen = _symbolic_calls(model, (5, 7))
    assert seen[1] - seen[0] == 1
    assert [len(s.regions) for s in splits] == [2]
    assert len(builds) == 2  # the static graph of the first size, the regions together


def test_regions_compile_alone_when_the_joint_compile_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("test: joint compile fails")

    torch.manual_seed(0)
    monkeypatch.setattr(dynamo, "compile_graphs", broken)
    seen = _symbolic_calls(_Chain().eval(), (5, 7, 11))
    assert seen[2] - seen[1] == 0
    assert seen[1] - seen[0] == 3  # the attempt, then each of the two regions alone


def test_training_with_a_symbolic_batch_matches_eager_gradients() -> None:
    torch.manual_seed(0)
    model = _Mixed()
    ref = _Mixed()
    ref.load_state_dict(model.state_dict())
    y = torch.randn(4, 16)
    torch._dynamo.reset()
    f = torch.compile(model, backend="opfuse")
    for n in (3, 9, 17):
        x = torch.randn(n, 16, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        sum(o.square().sum() for o in f(x, y)).backward()
        sum(o.square().sum() for o in ref(x2, y)).backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_split_cuts_static_regions_and_leaves_the_graph_alone() -> None:
    model = _Mixed().eval()
    graphs: list[tuple[torch.fx.GraphModule, Any]] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append((gm, example_inputs))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    f = torch.compile(model, backend=aot_autograd(fw_compiler=keep))
    with torch.no_grad():
        f(torch.randn(5, 16), torch.randn(4, 16))
        f(torch.randn(6, 16), torch.randn(4, 16))  # the batch becomes symbolic
    gm, examples = graphs[1]
    assert dynamic.has_symbols(examples)
    before = [n.format_node() for n in gm.graph.nodes]
    split = dynamic.split_static(gm)
    assert [n.format_node() for n in gm.graph.nodes] == before
    assert split.regions and split.symbols
    assert dynamic.static_share(gm) >= dynamo.GENERIC_SHARE
    for sub, ex in split.regions.values():
        assert not any(dynamic.symbolic(v) for v in ex)
        assert not any(
            dynamic.symbolic(n.meta.get("val")) for n in sub.graph.nodes if n.op != "output"
        )
    # the ops that read the symbolic input stay with torch
    assert any("sum" in op for op in split.dynamic_ops)
    torch._dynamo.reset()


def _compiles_over(f: Any, fn: Any, rows: Iterable[int], width: int) -> int:
    """Call `f` on (n, width) inputs for every n in rows, each result checked against
    `fn`'s; how many compiles the backend ran meanwhile."""
    before = dynamo.compiles()
    for n in rows:
        x = torch.randn(n, width)
        torch.testing.assert_close(f(x), fn(x))
    return dynamo.compiles() - before


def test_mostly_symbolic_graphs_compile_per_size_then_run_generically() -> None:
    """A graph whose work is all symbolic and whose every size decides otherwise (it divides
    by a third of the row count, a float the capture takes as a value: runtime/sized.py):
    each size compiles, up to the cache limit; past it the generic compile (here: nothing
    static, all torch) serves."""
    torch._dynamo.reset()
    fn = lambda x: (x * 2).relu().sum(-1) / (x.shape[0] / 3)
    f = torch.compile(fn, backend="opfuse", dynamic=True, options={"cache_limit": 2})
    with pytest.warns(RuntimeWarning, match="compiled for 2 input shapes.*static parts fused"):
        assert _compiles_over(f, fn, range(2, 7), 8) == 2
    torch._dynamo.reset()


def test_a_conv_net_with_symbolic_sizes_keeps_channels_last() -> None:
    """Dynamo restarts its analysis from inside the backend under dynamic=True (a float it
    traced as a tensor is specialised): that is its own signal, not a layout the relaid
    graph cannot take; caught, the net ran NCHW (MobileNetV2 b4 1.4x slower than static)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU6(),
        nn.Conv2d(16, 32, 1),
        nn.BatchNorm2d(32),
        nn.ReLU6(),
    ).eval()
    torch._dynamo.reset()
    f = torch.compile(net, backend="opfuse", dynamic=True)
    with torch.no_grad(), dynamo.listening() as reports:
        for b in (2, 3):
            x = torch.randn(b, 3, 8, 8)
            torch.testing.assert_close(f(x), net(x), rtol=1e-4, atol=1e-4)
    # the 1x1 convolution runs as a matmul over rows: only over a channels-last input
    # (the 3-channel stem becomes rows over any layout)
    per_size = [r for r in reports if not any("static regions" in d for d in r.dynamic)]
    assert [sum("1x1" in n for n in r.conv_rows) for r in per_size] == [1, 1]
    # what the first size decided from the sizes, and the second served by it (runtime/sized.py)
    assert all(any("decisions taken from the sizes" in d for d in r.dynamic) for r in per_size)
    assert "served by the compile" in per_size[1].dynamic[-1]
    torch._dynamo.reset()


def test_size_one_strides_make_no_new_signature() -> None:
    t = torch.randn(1, 12, 1, 64).as_strided((1, 12, 1, 64), (768, 64, 768, 1))
    u = dynamo._unit_strides(t)
    assert u.stride() == (768, 64, 64, 1) and torch.equal(u, t)
    assert dynamo._unit_strides(torch.randn(3, 4)).stride() == (4, 1)


def test_the_report_says_what_was_symbolic() -> None:
    r = FusionReport(dynamic=["graph with symbolic sizes (s0): 2 static regions"])
    merged = FusionReport().merge(r)
    assert ("dynamic", "graph with symbolic sizes (s0): 2 static regions") in notes(merged)


def test_sizes_of_a_symbolic_graph_compile_past_eight_until_their_pools_fill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default a graph with symbolic sizes keeps every size up to SIZES_LIMIT (served by
    its first compile, whose decisions hold at each: runtime/sized.py), until the kept
    sizes' memory pools reach POOL_BUDGET; an explicit cache_limit is the count for every
    graph."""
    import warnings

    torch._dynamo.reset()
    fn = lambda x: ((x * 2).relu() + 1).sum(-1) * x.amax(-1)
    f = torch.compile(fn, backend="opfuse", dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cache-limit warning
        assert _compiles_over(f, fn, range(2, 14), 300) == 1
    torch._dynamo.reset()
    monkeypatch.setattr(dynamo, "POOL_BUDGET", 1)  # full after the first size
    pooled = lambda x: ((x * 2).relu() @ x.t()).sum(-1)  # the relu's output is pooled
    f = torch.compile(pooled, backend="opfuse", dynamic=True)
    with pytest.warns(RuntimeWarning, match="memory pools reach"):
        assert _compiles_over(f, pooled, range(2, 6), 300) == 1
    torch._dynamo.reset()
