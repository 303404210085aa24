"""The fusion decision on small graphs, without a C compiler: which groups form and why the
others do not (fusion/rules.py), with the real lowering's answer and with a fake one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import opfuse.backends.c.build as c_build
from opfuse.context import Context
from opfuse.frontend.capture import capture_module
from opfuse.fusion.classify import classify
from opfuse.fusion.groups import Partition, Pattern, check_partition
from opfuse.fusion.partition import partition
from opfuse.fusion.rules import MAX_GROUP_NODES, Lowerable
from opfuse.ir.graph import Graph, Node
from opfuse.lower.lowering import why_not_lowered
from opfuse.options import Options
from opfuse.pipeline import rewrite
from tests.conftest import Fn


@pytest.fixture(autouse=True)
def _no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the fusion decision must not compile anything")

    monkeypatch.setattr(c_build, "build", refuse)
    monkeypatch.setattr(c_build, "toolchain", refuse)


def _decide(
    fn: Callable[..., Any] | torch.nn.Module,
    *args: torch.Tensor,
    lowerable: Lowerable = why_not_lowered,
) -> tuple[Graph, Partition]:
    model = fn if isinstance(fn, torch.nn.Module) else Fn(fn)
    graph = rewrite(capture_module(model.eval(), args).graph, Context(Options()))
    part = partition(graph, classify(graph), lowerable)
    check_partition(graph, part)
    return graph, part


def _patterns(part: Partition) -> list[str]:
    return sorted(str(g.pattern) for g in part.groups)


def test_softmax_is_one_reduction_kernel() -> None:
    _, part = _decide(lambda x: torch.softmax(x * 2, dim=-1), torch.randn(8, 32))
    assert _patterns(part) == ["reduction"]
    assert not part.rejected


def test_elementwise_dag_is_one_kernel() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = x + y
        return F.gelu(a) * a.sigmoid() + y.relu()

    _, part = _decide(f, torch.randn(4, 16), torch.randn(4, 16))
    assert _patterns(part) == ["elementwise"]
    assert len(part.groups[0].nodes) >= 5


def test_reductions_over_different_dims_are_two_kernels() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)[None, :] + x.sum(1)[:, None]

    _, part = _decide(f, torch.randn(8, 32))
    reasons = [r.reason for r in part.rejected]
    assert any("reduces dims [0]" in r or "reduces dims [1]" in r for r in reasons), reasons
    assert _patterns(part).count("reduction") == 2


def test_diamond_through_an_opaque_op_is_a_cycle_why_not() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a = x.relu()
        b = torch.cumsum(a, dim=1)  # runs with torch
        return a * 2 + b

    _, part = _decide(f, torch.randn(4, 16))
    assert any("cycle" in r.reason for r in part.rejected), [str(r) for r in part.rejected]
    assert "fallback" in _patterns(part)


def test_linear_takes_its_activation_as_epilogue() -> None:
    lin = torch.nn.Linear(16, 32)
    _, part = _decide(torch.nn.Sequential(lin, torch.nn.GELU()), torch.randn(4, 16))
    assert _patterns(part) == ["gemm_epilogue"]
    g = part.groups[0]
    assert g.pattern is Pattern.GEMM_EPILOGUE and g.anchor is not None


def test_linear_into_a_reduction_is_refused_with_the_reason() -> None:
    lin = torch.nn.Linear(16, 32)
    _, part = _decide(lambda x: lin(x).relu().sum(-1), torch.randn(4, 16))
    assert any("feeds a reduction (sum)" in r.reason for r in part.rejected)
    assert sorted(_patterns(part)) == ["library", "reduction"]


def test_epilogue_read_outside_is_refused() -> None:
    lin = torch.nn.Linear(16, 16)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = lin(x)
        return y.relu(), y  # the matmul's result is an output too

    _, part = _decide(f, torch.randn(4, 16))
    assert any("also read outside the epilogue" in r.reason for r in part.rejected)


def test_the_lowering_is_asked_only_what_the_rules_cannot_answer() -> None:
    """A lowering that refuses everything leaves one group per op, each refusal in its
    words; it is asked with the merged members, never for a schedule."""
    asked: list[list[str]] = []

    def never(graph: Graph, members: Sequence[Node]) -> str | None:
        asked.append([m.name for m in members])
        return "the fake lowering says no"

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x + 1).relu() * 3

    _, part = _decide(f, torch.randn(4, 16), lowerable=never)
    assert _patterns(part) == ["elementwise"] * 3
    assert asked and all(len(a) == 2 for a in asked)
    assert {r.reason for r in part.rejected} == {"the fake lowering says no"}


def test_group_size_is_capped() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        for _ in range(MAX_GROUP_NODES + 20):
            x = x * 1.0001
        return x

    _, part = _decide(f, torch.randn(4, 8))
    assert len(part.groups) == 2
    assert any(f"exceed {MAX_GROUP_NODES} ops" in r.reason for r in part.rejected)
