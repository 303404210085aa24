"""Capture's op-by-op decomposition (opfuse/frontend/decompose.py) against make_fx's whole-graph
retrace: the same ops, the same results, and one trace per distinct op and layout."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opfuse
from opfuse.bench.models import build
from opfuse.frontend import capture, decompose
from tests.conftest import assert_matches_eager


class Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, s, d)))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(Block() for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.BatchNorm2d(8)
        self.b1.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(torch.relu(self.b1(self.c1(x))), 2)
        y = F.silu(self.b2(self.c2(y))) + y
        z = F.interpolate(y, scale_factor=2.0, mode="bilinear")
        return F.adaptive_avg_pool2d(z, 1).flatten(1)


def _exported(m: nn.Module, args: tuple[Any, ...]) -> torch.fx.GraphModule:
    ep = torch.export.export(capture._Flat(m.eval(), []), args, {}, strict=False)
    return ep.graph_module


def _whole_retrace(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The previous capture step: make_fx over the whole exported graph."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    vals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) for v in vals]
    with enable_python_dispatcher(), decompose.keep_whole():
        return make_fx(
            torch.fx.Interpreter(gm).run,
            decomposition_table=decompose.decompositions(),
            tracing_mode="fake",
        )(*fakes)


def _ops(gm: torch.fx.GraphModule) -> Counter[str]:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize(
    "case",
    [
        lambda: (Stack(), (torch.randn(2, 8, 32),)),
        lambda: (ConvNet(), (torch.randn(2, 3, 16, 16),)),
        lambda: build("resnet50", 1),
    ],
    ids=["transformer", "convnet", "resnet50"],
)
def test_op_by_op_decomposition_equals_the_whole_graph_retrace(case: Any) -> None:
    m, args = case()
    gm = _exported(m, args)
    ours = capture._decompose_functional(gm)
    assert ours is not None
    whole = _whole_retrace(gm)
    assert _ops(ours) == _ops(whole)
    # the exported graph takes parameters as inputs: run both on the same random values
    # (positive: BatchNorm's variances)
    inputs = [
        torch.rand(n.meta["val"].shape, generator=torch.Generator().manual_seed(i)) + 0.5
        if n.meta["val"].is_floating_point()
        else torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype)
        for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))
    ]
    with torch.no_grad():
        for a, b in zip(ours(*inputs), whole(*inputs), strict=True):
            torch.testing.assert_close(a, b)


def test_repeated_blocks_trace_each_op_once(monkeypatch: pytest.MonkeyPatch) -> None:
    traced: list[int] = []
    real = decompose._trace

    def spy(ops: list[Any], *a: Any) -> bool:
        traced.append(len(ops))
        return real(ops, *a)

    monkeypatch.setattr(decompose, "_trace", spy)
    x = torch.randn(2, 8, 32)
    one = capture._decompose_functional(_exported(Stack(1), (x,)))
    three = capture._decompose_functional(_exported(Stack(3), (x,)))
    assert one is not None and three is not None
    assert len(traced) == 2 and traced[0] == traced[1], "blocks of the same shapes traced again"
    assert len(three.graph.nodes) > 2 * len(one.graph.nodes)


def test_compiled_blocks_match_eager() -> None:
    m, x = Stack().eval(), torch.randn(2, 8, 32)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    c, y = ConvNet().eval(), torch.randn(2, 3, 16, 16)
    fast = opfuse.compile(c, (y,))
    assert_matches_eager(c, fast(y), (y,))


def _export_symbolic(model: nn.Module, x: torch.Tensor, dims: dict[int, Any]) -> Any:
    return torch.export.export(model.eval(), (x,), strict=False, dynamic_shapes=(dims,))


@pytest.mark.parametrize(
    ("model", "shape", "dims"),
    [
        # linear and LayerNorm decompose (a view of a size computed from the symbol);
        # the length is a symbol
        (
            nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU(), nn.Softmax(-1)),
            (2, 7, 16),
            {1: torch.export.Dim.AUTO},
        ),
        # conv2d decomposes to convolution, whose fake kernel guards on the image size
        # to choose its output's layout (a guard of layout only, taken)
        (
            nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU6()),
            (1, 3, 20, 20),
            {2: torch.export.Dim.AUTO, 3: torch.export.Dim.AUTO},
        ),
    ],
)
def test_a_symbolic_export_is_retraced_op_by_op(
    monkeypatch: pytest.MonkeyPatch, model: nn.Module, shape: tuple[int, ...], dims: Any
) -> None:
    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("run_decompositions was called")

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", refuse)
    x = torch.randn(shape)
    exported = capture.export_model(capture._Flat, model.eval(), (x,), {}, ((dims,),))
    assert exported.symbolic and isinstance(exported.program, capture._Retraced)
    gm = exported.program.graph_module
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & {"aten.layer_norm.default", "aten.linear.default", "aten.conv2d.default"}
    compiled = opfuse.compile(model, (x,), dynamic_shapes=(dims,))
    with torch.no_grad():
        for grow in (0, 3, 5):
            y = torch.randn(*(s + grow if i in dims else s for i, s in enumerate(shape)))
            torch.testing.assert_close(compiled(y), model(y), rtol=1e-4, atol=1e-4)


def test_a_decomposition_that_guards_on_a_symbol_is_refused() -> None:
    """A decomposition that assumes something of the sizes (here: which branch) would hold
    only where that assumption does; the retrace gives up and capture decomposes with
    run_decompositions instead."""

    def branching_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return x * 2 if x.shape[1] > 5 else x * 3

    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    ep = _export_symbolic(model, torch.randn(2, 7, 4), {1: torch.export.Dim.AUTO})
    table = {torch.ops.aten.gelu.default: branching_gelu}
    assert decompose.retrace(ep.graph_module, table, contextlib.nullcontext) is None
    plain = {torch.ops.aten.gelu.default: lambda x, approximate="none": x * 2}
    assert decompose.retrace(ep.graph_module, plain, contextlib.nullcontext) is not None


def test_a_refused_symbolic_retrace_leaves_the_sizes_symbolic() -> None:
    """Bilinear upsampling's composite makes the batch a constant while it is traced
    (Eq(s0, 5)); the retrace refuses it, and the export decomposed instead must be one
    that guard never touched: the batch stays a symbol."""

    class Up(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            return self.conv(y)

    model, x = Up().eval(), torch.randn(5, 2, 8, 8)
    dims = ({0: torch.export.Dim.AUTO},)
    exported = capture.export_model(capture._Flat, model, (x,), {}, (dims,))
    assert exported.symbolic
    compiled = opfuse.compile(model, (x,), dynamic_shapes=dims)
    with torch.no_grad():
        for b in (3, 7):
            y = torch.randn(b, 2, 8, 8)
            torch.testing.assert_close(compiled(y), model(y), rtol=1e-4, atol=1e-4)
    assert all("symbolic sizes" in " ".join(e.report.dynamic) for e in compiled._entries.values())
