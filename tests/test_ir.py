"""The IR's text form, its checker, and the per-pass dumps of OPFUSE_DEBUG_DIR."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import opfuse
from opfuse.context import Context
from opfuse.frontend.capture import capture_module
from opfuse.ir.graph import Graph, Node
from opfuse.ir.printer import format_graph
from opfuse.ir.verify import InvalidGraph, verify
from opfuse.options import Options
from opfuse.pipeline import rewrite
from opfuse.rewrite.passes import REWRITES
from tests.conftest import Fn


def _graph() -> Graph:
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU())
    return capture_module(m.eval(), (torch.randn(2, 8),)).graph


def test_graph_prints_one_line_per_node() -> None:
    text = format_graph(_graph())
    lines = text.splitlines()
    assert lines[0].startswith("graph(%") and ": f32[2,8]" in lines[0]
    assert any(" = constant : f32[8,8]" in line for line in lines)
    assert any(line.lstrip().startswith("%gelu = gelu(") for line in lines), text
    assert any("# 2" in line or "# 0" in line for line in lines)  # the module path
    assert lines[-1].startswith("  return (%")


def test_printer_shows_strides_that_are_not_contiguous() -> None:
    g = capture_module(Fn(lambda x: x.t() + 1), (torch.randn(3, 5),)).graph
    assert "f32[5,3]{1,5}" in format_graph(g)


def test_verify_accepts_every_rewritten_graph() -> None:
    ctx = Context(Options(verify=True))
    g = rewrite(_graph(), ctx)
    verify(g)
    assert set(ctx.seconds) == {p.__name__ for p in REWRITES}


def test_verify_names_what_is_broken() -> None:
    g = _graph()
    add = next(n for n in reversed(g.nodes) if n.inputs())
    # the node moved before what it reads, and a duplicate name
    nodes = [add] + [n for n in g.nodes if n is not add]
    with pytest.raises(InvalidGraph, match="not defined before it"):
        verify(dataclasses.replace(g, nodes=tuple(nodes)), after="a test")
    twin = Node(g.nodes[-1].name, "aten.relu.default", (g.nodes[-2],), meta=g.nodes[-2].meta)
    with pytest.raises(InvalidGraph, match="two values are named"):
        verify(dataclasses.replace(g, nodes=(*g.nodes, twin)))
    with pytest.raises(InvalidGraph, match="constant"):
        verify(dataclasses.replace(g, constants={}))


def test_a_pass_that_breaks_the_graph_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(graph: Graph, ctx: Context) -> Graph:
        return dataclasses.replace(graph, nodes=graph.nodes[::-1])

    with pytest.raises(InvalidGraph, match="after broken"):
        Context(Options(verify=True)).run(broken, _graph())


def test_debug_dir_holds_the_graph_after_every_pass(tmp_path: Path) -> None:
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    fast = opfuse.compile(m, (torch.randn(2, 8),), options=Options(debug_dir=str(tmp_path)))
    (run,) = tmp_path.iterdir()
    names = sorted(p.name for p in run.iterdir())
    assert (
        names[0] == "01-fold_batchnorm.txt" and f"{len(REWRITES):02d}-" in names[len(REWRITES) - 1]
    )
    assert {"source.c", "report.txt", "report.json"} <= set(names)
    assert (run / names[0]).read_text().startswith("graph(")
    assert {"partition", "lower", "tune", "fold_batchnorm"} <= set(fast.report.passes)


def test_a_new_op_lives_on_the_device_its_arguments_name() -> None:
    """A factory's `device=` (and opfuse.seed's device argument) decide where its result
    lives, not the first tensor argument (or 'cpu' for none): a CUDA graph's rewritten
    seed said 'cpu' and its kernel was handed a scratch buffer on the wrong device."""
    from opfuse.ir.graph import TensorMeta
    from opfuse.ir.meta import infer_meta
    from opfuse.rewrite import random  # noqa: F401  (registers opfuse.seed)

    aten = torch.ops.aten
    z = infer_meta(aten.zeros.default, ([2, 3],), {"device": torch.device("meta")})
    assert z == TensorMeta((2, 3), (3, 1), torch.float32, "meta")
    s = infer_meta(torch.ops.opfuse.seed.default, (torch.device("meta"),), {})
    assert s.device == "meta" and s.dtype == torch.int64 and s.shape == ()
    on = Node("x", "input", meta=TensorMeta((4,), (1,), torch.float32, "meta"))
    assert infer_meta(aten.sin.default, (on,), {}).device == "meta"
