"""The partition is a true partition with no cycle between groups, for any DAG: random
branches that mix pointwise ops with matmuls and convolutions and exchange values."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opfuse
from opfuse.context import Context
from opfuse.frontend.capture import capture_module
from opfuse.fusion.classify import classify
from opfuse.fusion.groups import check_partition
from opfuse.fusion.partition import partition
from opfuse.lower.lowering import why_not_lowered
from opfuse.options import Options
from opfuse.pipeline import rewrite
from tests.conftest import Fn, assert_matches_eager


class Exchange(torch.nn.Module):
    """Two branches that exchange values through linears (HRNet's fuse layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Linear(16, 16)
        self.q = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.relu(), y.relu()
        return self.p(b) + a, self.q(a) + b


def _partition(model: torch.nn.Module, args: tuple[Any, ...]) -> Any:
    graph = rewrite(capture_module(model, args).graph, Context(Options()))
    part = partition(graph, classify(graph), why_not_lowered)
    check_partition(graph, part)
    return graph, part


def test_branches_that_exchange_values_fuse_without_a_cycle() -> None:
    torch.manual_seed(0)
    m = Exchange().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    fast = opfuse.compile(m, args)  # a fallback warning is an error under pytest
    assert_matches_eager(m, fast(*args), args)
    report = fast.report
    assert report.kernels_after == 3, str(report)
    assert [g.pattern for g in report.groups].count("gemm_epilogue") == 2
    assert any("cycle" in r.reason for r in report.rejected), str(report)


def test_branches_that_exchange_values_train() -> None:
    torch.manual_seed(0)
    m = Exchange().train()
    ref = Exchange().train()
    ref.load_state_dict(m.state_dict())
    x, y = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    x2, y2 = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    fast = opfuse.compile(m, (x, y))
    a, b = fast(x, y)
    (a.sum() + 2 * b.sum()).backward()
    ra, rb = ref(x2, y2)
    (ra.sum() + 2 * rb.sum()).backward()
    torch.testing.assert_close(a, ra)
    torch.testing.assert_close(b, rb)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(m.p.weight.grad, ref.p.weight.grad)


_CONVS = {"unary": 0, "binary": 0, "conv": 1, "linear": 0, "exchange": 2}
POINTWISE = [torch.relu, torch.sigmoid, torch.tanh, F.gelu, lambda t: t * 0.5 + 1.0]


@st.composite
def branchy(draw: Any) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Values of one shape [n, c, 6, 6]; each step applies a pointwise op, a binary op of
    two earlier values (from any branch), a 1x1 convolution, a linear over channels, or
    makes two values exchange (a' = f(a) + conv(g(b)), b' = conv(f(a)) + g(b))."""
    n, c = draw(st.integers(1, 2)), draw(st.sampled_from([4, 8]))
    n_inputs = draw(st.integers(1, 3))
    steps: list[tuple[str, int, int, int]] = []
    count = n_inputs
    for _ in range(draw(st.integers(2, 12))):
        kind = draw(st.sampled_from(["unary", "binary", "conv", "linear", "exchange"]))
        steps.append(
            (kind, draw(st.integers(0, count - 1)), draw(st.integers(0, count - 1)),
             draw(st.integers(0, 100)))
        )  # fmt: skip
        count += 2 if kind == "exchange" else 1
    outs = sorted(set(draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=3))))
    convs = torch.nn.ModuleList(
        torch.nn.Conv2d(c, c, 1) for kind, *_ in steps for _ in range(_CONVS[kind])
    )
    linears = torch.nn.ModuleList(torch.nn.Linear(c, c) for kind, *_ in steps if kind == "linear")

    def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vals, ci, li = list(xs), iter(convs), iter(linears)
        for kind, a, b, op in steps:
            if kind == "unary":
                vals.append(POINTWISE[op % len(POINTWISE)](vals[a]))
            elif kind == "binary":
                vals.append(vals[a] + vals[b] if op % 2 else vals[a] * vals[b])
            elif kind == "conv":
                vals.append(next(ci)(vals[a]))
            elif kind == "exchange":
                f, g = POINTWISE[op % len(POINTWISE)], POINTWISE[(op // 7) % len(POINTWISE)]
                u, v = f(vals[a]), g(vals[b])
                vals += [u + next(ci)(v), next(ci)(u) + v]
            else:
                vals.append(next(li)(vals[a].transpose(1, 3)).transpose(1, 3))
        return tuple(vals[k] for k in outs)

    m = Fn(fn)
    m.convs, m.linears = convs, linears
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    return m.eval(), tuple(torch.randn(n, c, 6, 6, generator=g) for _ in range(n_inputs))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(branchy())
def test_random_branchy_dags_partition_into_acyclic_groups(case: Any) -> None:
    model, args = case
    _partition(model, args)  # check_partition asserts a partition in dependency order


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(branchy())
def test_random_branchy_dags_compile_and_match_eager(case: Any) -> None:
    model, args = case
    fast = opfuse.compile(model, args)
    assert_matches_eager(model, fast(*args), args)
