"""The public API: output structures, the caller's state, kwargs, fallbacks, the entry point."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import opfuse
from opfuse import pipeline
from tests.conftest import Fn, assert_matches_eager


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    aux: Any = None


@dataclasses.dataclass(frozen=True)
class FrozenOut:
    a: torch.Tensor
    b: torch.Tensor


class ModelOutputLike(OrderedDict):  # the shape of transformers' ModelOutput
    pass


pytree.register_pytree_node(
    ModelOutputLike,
    lambda d: (list(d.values()), list(d.keys())),
    lambda values, keys: ModelOutputLike(zip(keys, values)),
)

Pair = namedtuple("Pair", "first second")


STRUCTURES = {
    "tensor": lambda a, b: a + b,
    "tuple": lambda a, b: (a + b, a * b),
    "list": lambda a, b: [a.relu(), (b.exp(), a - 1)],
    "dict": lambda a, b: {"x": a.sigmoid(), "y": {"z": b * 2}, "n": None, "s": "text"},
    "namedtuple": lambda a, b: Pair(a * 3, b.tanh()),
    "dataclass": lambda a, b: Out(a + b, (a, b.neg()), aux=7),
    "frozen_dataclass": lambda a, b: FrozenOut(a * b, a / 2),
    "pytree_registered": lambda a, b: ModelOutputLike(last=a + 1, pooled=b.sum(-1)),
}


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_output_structure_is_preserved(name: str) -> None:
    m = Fn(STRUCTURES[name]).eval()
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    ours = opfuse.compile(m, (a, b))(a, b)
    ref = m(a, b)
    assert type(ours) is type(ref)
    assert pytree.tree_structure(ours) == pytree.tree_structure(ref) or dataclasses.is_dataclass(
        ref
    )
    assert_matches_eager(m, ours, (a, b))
    if isinstance(ref, Out):
        assert ours.aux == 7 and isinstance(ours.hidden, tuple)


def test_kwargs_inputs() -> None:
    class M(nn.Module):
        def forward(
            self, x: torch.Tensor, *, scale: torch.Tensor, bias: float = 1.0
        ) -> torch.Tensor:
            return x * scale + bias

    m = M().eval()
    x, s = torch.randn(3, 4), torch.randn(4)
    fast = opfuse.compile(m, (x,), example_kwargs={"scale": s, "bias": 2.0})
    torch.testing.assert_close(fast(x, bias=2.0, scale=s), m(x, scale=s, bias=2.0))
    torch.testing.assert_close(fast(x, scale=s, bias=-1.0), m(x, scale=s, bias=-1.0))  # recompiles


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 4)).eval()


def test_caller_module_and_inputs_are_not_mutated() -> None:
    m = _mlp()
    before = copy.deepcopy(m.state_dict())
    params_before = {k: v.data_ptr() for k, v in m.state_dict().items()}
    attrs_before = set(m.__dict__)
    x = torch.randn(5, 8)
    x_before = x.clone()
    fast = opfuse.compile(m, (x,))
    fast(x)
    fast.train()  # the wrapper's mode is its own
    assert not m.training
    after = m.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
        assert after[k].data_ptr() == params_before[k]
    assert set(m.__dict__) == attrs_before
    assert not m._forward_hooks and not m._forward_pre_hooks
    assert torch.equal(x, x_before)


def test_eval_mode_with_inputs_requiring_grad_gives_eager_gradients() -> None:
    m = _mlp()
    x1 = torch.randn(5, 8, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    fast = opfuse.compile(m, (x1.detach(),))
    fast(x1).sum().backward()
    m(x2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)


def test_plain_functions_compile_and_explain() -> None:
    w = torch.randn(8, 16)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w + y).sum(-1)  # closes over w

    x, y = torch.randn(4, 8), torch.randn(16)
    fast = opfuse.compile(f, (x, y))
    assert isinstance(fast, opfuse.CompiledModule)
    torch.testing.assert_close(fast(x, y), f(x, y))
    assert fast.report.kernels_after < fast.report.kernels_before
    assert opfuse.explain(f, (x, y)).groups
    lam = opfuse.compile(lambda a: torch.relu(a) * 2 + 1, torch.randn(6))
    a = torch.randn(6)
    torch.testing.assert_close(lam(a), torch.relu(a) * 2 + 1)
    with pytest.raises(TypeError, match=r"a torch\.nn\.Module or a function, got int"):
        opfuse.compile(42, (x,))  # type: ignore[arg-type]


def test_new_signatures_beyond_the_cache_limit_run_with_torch() -> None:
    m = _mlp()
    fast = opfuse.compile(m, torch.randn(2, 8), cache_limit=2)
    assert isinstance(fast, opfuse.CompiledModule)
    fast(torch.randn(3, 8))
    with pytest.warns(RuntimeWarning, match="cache_limit=2.*run with torch, unfused"):
        x = torch.randn(5, 8)
        torch.testing.assert_close(fast(x), m(x))
    assert len(fast._entries) == 2 and fast._dynamo is None  # nothing compiled for it
    x = torch.randn(2, 8)  # a compiled signature still runs its kernels
    torch.testing.assert_close(fast(x), m(x))
    with pytest.raises(ValueError, match="cache_limit"):
        opfuse.compile(m, x, cache_limit=0)


def test_torch_compile_backend_compiles_each_graph_for_a_bounded_number_of_shapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opfuse.frontend import dynamo

    compiles: list[int] = []
    real = dynamo._GraphRunner._compile

    def counting(self: Any, *args: Any) -> Any:
        compiles.append(1)
        return real(self, *args)

    monkeypatch.setattr(dynamo._GraphRunner, "_compile", counting)
    torch._dynamo.reset()
    # (it divides by a third of the row count, a float the capture takes as a value:
    # every size decides otherwise, none is served by the compile of another,
    # runtime/sized.py)
    fn = lambda x: (x * 2).relu().sum(-1) / (x.shape[0] / 3)
    f = torch.compile(fn, backend="opfuse", options={"cache_limit": 3})
    with pytest.warns(RuntimeWarning, match="compiled for 3 input shapes.*'cache_limit'"):
        for n in range(1, 13):
            x = torch.randn(n, 8)
            torch.testing.assert_close(f(x), fn(x))
    # the first call's static graph, then the dynamic graph's first three shapes
    assert len(compiles) == 4
    torch._dynamo.reset()
    # (checked directly: a backend that raises inside dynamo leaves every later frame's
    # tensors with one more reference, and the runtime then never donates one)
    with pytest.raises(ValueError, match=r"unknown options \['cache_limt'\].*cache_limit"):
        dynamo.backend_options({"cache_limt": 3})
    with pytest.raises(ValueError, match=r"Options\.layout"):
        dynamo.backend_options({"layout": "nchw"})


def test_python_scalar_inputs_are_specialised() -> None:
    m = Fn(lambda x, n: x * n + n).eval()
    x = torch.randn(4)
    fast = opfuse.compile(m, (x, 3))
    torch.testing.assert_close(fast(x, 3), m(x, 3))
    torch.testing.assert_close(fast(x, 5), m(x, 5))


def test_buffer_mutation_keeps_private_state() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return x * self.calls

    m = Counter().eval()
    ref = copy.deepcopy(m)
    x = torch.ones(3)
    fast = opfuse.compile(m, (x,))
    assert float(m.calls) == 0  # compiling ran nothing on the caller's module
    for _ in range(3):
        torch.testing.assert_close(fast(x), ref(x))
    assert float(m.calls) == 0


def test_input_mutation_matches_eager() -> None:
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)
            return x + 1

    m = Scale().eval()
    a, b = torch.randn(4), None
    b = a.clone()
    fast = opfuse.compile(m, (a.clone(),))
    out = fast(a)
    ref = m(b)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(a, b)  # mutated like eager mutated its input


def test_untraceable_model_falls_back_and_stays_correct(capsys: pytest.CaptureFixture[str]) -> None:
    """One warning that names the model's line, and none of torch.export's partial graphs
    on stderr (two of them, 30 lines each, before)."""

    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
                return (x * 2).relu()
            return x.exp() - 1

    m = DataDependent().eval()
    with pytest.warns(RuntimeWarning, match="torch.compile") as caught:
        fast = opfuse.compile(m, (torch.ones(4),))
    (message,) = [str(w.message) for w in caught if "opfuse" in str(w.message)]
    assert "if x.sum() > 0:" in message and "\n" not in message, message
    assert "def forward" not in capsys.readouterr().err
    for x in (torch.ones(4), -torch.ones(4)):
        torch.testing.assert_close(fast(x), m(x))


def test_a_recompile_export_cannot_trace_falls_back_like_the_first_compile() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 4 and x.sum() > 0:  # data-dependent only at larger batches
                return x * 2
            return x + 1

    m = Branchy().eval()
    fast = opfuse.compile(m, (torch.randn(2, 3),))
    with pytest.warns(RuntimeWarning, match="these inputs run through torch.compile"):
        out = fast(torch.ones(8, 3))
    torch.testing.assert_close(out, m(torch.ones(8, 3)))
    for x in (torch.ones(8, 3), -torch.ones(8, 3), torch.randn(2, 3)):  # no second warning
        torch.testing.assert_close(fast(x), m(x))


def test_a_models_own_exception_at_a_new_shape_comes_back_as_its_own() -> None:
    class Picky(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 5:
                raise ValueError("a batch of five is not allowed")
            return x + 1

    fast = opfuse.compile(Picky().eval(), (torch.randn(2, 3),))
    with (
        pytest.warns(RuntimeWarning, match="torch.compile"),
        pytest.raises(ValueError, match="a batch of five is not allowed"),
    ):
        fast(torch.ones(5, 3))
    with pytest.raises(ValueError, match="a batch of five is not allowed"):
        fast(torch.ones(5, 3))
    torch.testing.assert_close(fast(torch.ones(2, 3)), torch.full((2, 3), 2.0))


def test_data_dependent_shape_falls_back_and_stays_correct() -> None:
    class Unique(nn.Module):  # export traces it, with an unbacked size: no static kernel
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.relu() + torch.unique(x.round()).numel()

    m = Unique().eval()
    with pytest.warns(RuntimeWarning, match="depends on the data"):
        fast = opfuse.compile(m, (torch.randn(5, 8),))
    for x in (torch.randn(5, 8), torch.randn(5, 8) * 9):
        torch.testing.assert_close(fast(x), m(x))


def test_a_compile_bug_falls_back_to_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise IndexError("a bug in a later stage")

    monkeypatch.setattr(opfuse.compiled, "compile_graph", broken)
    m = _mlp().eval()
    x = torch.randn(3, 8)
    with pytest.warns(RuntimeWarning, match="IndexError: a bug in a later stage"):
        fast = opfuse.compile(m, (x,))
        with torch.no_grad():
            out = fast(x)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x))
    assert any("IndexError" in w for w in fast.report.warnings)


def test_options_as_a_dict_reach_every_path_and_a_wrong_one_is_an_error() -> None:
    """opfuse.compile's and explain's `options` may be a dict of Options' fields, as
    torch.compile's are, and reach the torch.compile paths too (training mode, inputs
    that require grad, explain in training mode). Misspelt names and other types are
    errors, not a compile that fails and falls back to torch."""
    from opfuse.frontend import dynamo

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU()).eval()
    x = torch.randn(8, 16)
    forced = "forced by Options.implementation"
    with torch.no_grad():
        fast = opfuse.compile(m, (x,), options={"implementation": "blocked"})
        assert_matches_eager(m, fast(x), (x,))
    assert [g.implementation.split(" (")[0] for g in fast.report.groups] == ["blocked"]
    with dynamo.listening() as reports:
        xg = x.clone().requires_grad_()
        fast(xg).sum().backward()  # (inputs that require grad: through torch.compile)
        opfuse.compile(copy.deepcopy(m).train(), (x,), options={"implementation": "blocked"})(
            x
        ).sum().backward()
    assert xg.grad is not None
    gemms = [g for r in reports for g in r.groups if g.implementation]
    assert len(gemms) >= 4 and all(forced in g.implementation for g in gemms)
    report = opfuse.explain(copy.deepcopy(m).train(), (x,), options={"implementation": "blocked"})
    explained = [g.implementation for g in report.groups if g.implementation]
    assert explained and all(forced in i for i in explained)
    with pytest.raises(ValueError, match=r"^opfuse\.compile: unknown options \['implementaton'\]"):
        opfuse.compile(m, (x,), options={"implementaton": "unfused"})
    with pytest.raises(TypeError, match=r"^opfuse\.explain: options must be an opfuse\.Options"):
        opfuse.explain(m, (x,), options=["unfused"])  # type: ignore[arg-type]
    # the backend's graphs take parameters as inputs: `freeze` is not one of its options
    with pytest.raises(ValueError, match=r"^opfuse backend: unknown options \['freeze'\]"):
        dynamo.backend_options({"freeze": True})
    assert dynamo.backend_options(opfuse.Options(implementation="blocked")) == (
        opfuse.Options(implementation="blocked", freeze=False),
        None,
    )


def test_misspelt_options_are_errors_not_fallbacks() -> None:
    with pytest.raises(ValueError, match=r"Options\.layout"):
        opfuse.Options(layout="nchw")
    with pytest.raises(ValueError, match=r"Options\.random"):
        opfuse.Options(random="philox")
    with pytest.raises(ValueError, match=r"Options\.implementation.*'onednn'.*not 'onedn'"):
        opfuse.Options(implementation="onedn")
    with pytest.raises(ValueError, match=r"Options\.fold_batchnorm"):
        opfuse.Options(fold_batchnorm="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Options\.fuel"):
        opfuse.Options(fuel=-1)


@pytest.mark.parametrize(
    ("name", "value", "valid"),
    [
        ("OPFUSE_IMPLEMENTATION", "onedn", "'onednn'"),
        ("OPFUSE_LAYOUT", "nhwc", "'channels-last'"),
        ("OPFUSE_RANDOM", "philox", "'kernel'"),
        ("OPFUSE_BACKEND", "cuda", "'triton'"),
        ("OPFUSE_FUEL", "ten", "whole number"),
        ("OPFUSE_NO_PROGRESS", "maybe", "'1'"),
    ],
)
def test_misspelt_environment_variables_are_errors_listing_the_valid_values(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, valid: str
) -> None:
    monkeypatch.setenv(name, value)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    with pytest.raises(ValueError, match=f"{name}.*{valid}.*|{name} must be a {valid}"):
        if name == "OPFUSE_NO_PROGRESS":
            from opfuse.tools.progress import Progress

            Progress(2, "x")
        else:
            opfuse.compile(m, (torch.randn(2, 4),))


def test_a_misspelt_log_target_is_an_error_at_import() -> None:
    import subprocess
    import sys

    env = dict(os.environ, OPFUSE_LOG="fusoin")
    out = subprocess.run(
        [sys.executable, "-c", "import opfuse"], env=env, capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "OPFUSE_LOG must be one of 'fusion', 'autotune', 'triton', 'all'" in out.stderr


class _Linear2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(x))) + x


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.randn(0, 8), id="empty-batch"),
        pytest.param(lambda: torch.randn(1, 8).expand(5, 8), id="expanded-stride-0"),
        pytest.param(lambda: torch.randn(2, 0, 8)[:, :, :8], id="empty-middle-dim"),
    ],
)
def test_degenerate_inputs_compile_and_match(make: Any) -> None:
    torch.manual_seed(0)
    m, x = _Linear2().eval(), make()
    with torch.no_grad():
        assert_matches_eager(m, opfuse.compile(m, (x,))(x), (x,))
    torch._dynamo.reset()
    ours, ref = copy.deepcopy(m).train(), copy.deepcopy(m).train()
    torch.compile(ours, backend="opfuse")(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad)


def test_explain_report_fields() -> None:
    m = _mlp()
    r = opfuse.explain(m, torch.randn(5, 8))
    assert r.kernels_before > r.kernels_after >= 2
    for g in r.groups:
        assert g.pattern in (
            "elementwise",
            "reduction",
            "gemm_epilogue",
            "conv_epilogue",
            "library",
            "fallback",
        )
        assert g.ops and g.modules
    assert isinstance(r.folds, list) and isinstance(r.rejected, list)
    assert "pattern" in str(r)
    import json

    json.dumps(r.to_dict())


def test_torch_compile_backend_registered_by_entry_point() -> None:
    code = textwrap.dedent(
        """
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
        out = torch.compile(m, backend="opfuse")(torch.randn(2, 4))
        assert "opfuse" not in [k.split(".")[0] for k in list(sys.modules)][:0]
        out.sum().backward()
        print("ok", "opfuse" in sys.modules)
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["ok", "True"]  # loaded by torch through the entry point


def test_torch_compile_backend_registered_by_import_without_an_entry_point() -> None:
    """opfuse run from a checkout on PYTHONPATH (no installed metadata): importing it
    registers the backend."""
    code = textwrap.dedent(
        """
        import importlib.metadata as md
        real = md.entry_points
        md.entry_points = lambda **kw: (
            md.EntryPoints([]) if kw.get("group") == "torch_dynamo_backends" else real(**kw)
        )
        import torch, opfuse
        from torch._dynamo.backends.registry import lookup_backend
        from opfuse.frontend.dynamo import opfuse_backend
        assert lookup_backend("opfuse") is opfuse_backend
        opfuse._register_backend()  # a second import's registration is a no-op
        x = torch.randn(3, 5)
        f = torch.compile(lambda t: t.sin() * 2, backend="opfuse")
        print(torch.allclose(f(x), x.sin() * 2))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["True"]


def test_torch_compile_inference_under_no_grad() -> None:
    m = _mlp()
    x = torch.randn(6, 8)
    with torch.no_grad():
        out = torch.compile(m, backend="opfuse")(x)
    torch.testing.assert_close(out, m(x))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.bn(self.fc(x)).softmax(-1) + x)


def _capture_both_ways(monkeypatch: pytest.MonkeyPatch, m: nn.Module, args: Any) -> Any:
    """(fast capture, run_decompositions capture, run_decompositions calls in the first)."""
    from opfuse.frontend import capture

    calls = []
    real = torch.export.ExportedProgram.run_decompositions

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counted)
    fast = capture.capture_module(m, args)
    n_fast = len(calls)
    monkeypatch.setattr(capture, "_decompose_functional", lambda gm: None)
    slow = capture.capture_module(m, args)
    return fast, slow, n_fast


def _ops_and_sources(graph: Any) -> list[tuple[str, str, str]]:
    return [(n.op, str(n.meta), str(n.source)) for n in graph.nodes]


def test_functional_model_is_decomposed_in_one_retrace(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _Block().eval()
    fast, slow, n_fast = _capture_both_ways(monkeypatch, m, (torch.randn(4, 8),))
    assert n_fast == 0  # no second export through run_decompositions
    # the same graph, op for op, with each op's module and source line
    assert _ops_and_sources(fast.graph) == _ops_and_sources(slow.graph)
    ops = {n.op for n in fast.graph.nodes}
    assert "aten._native_batch_norm_legit_no_training.default" in ops  # kept for folding
    assert "aten.native_layer_norm.default" not in ops
    assert any(n.source is not None and n.source.module == "ln" for n in fast.graph.nodes)
    assert fast.input_roles == slow.input_roles and fast.output_roles == slow.output_roles


def test_mutating_model_is_functionalized_by_run_decompositions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Mutates(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            y = x * 2
            y.relu_()
            return y + self.calls

    fast, _, n_fast = _capture_both_ways(monkeypatch, Mutates().eval(), (torch.randn(4),))
    assert n_fast == 1
    assert ("state", "m.calls") in fast.output_roles


@pytest.mark.parametrize("cell", [nn.GRU, nn.RNN])
def test_gru_and_rnn_stay_one_call(cell: type[nn.Module]) -> None:
    """Decomposed, a recurrent layer unrolls into ops per time step (a 2-layer bidirectional
    GRU over 50 steps: 816 kernels, 3x slower than eager); it runs as torch's one call."""

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = cell(8, 16, num_layers=2, batch_first=True, bidirectional=True)
            self.head = nn.Linear(32, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.rnn(x)
            return self.head(out).log_softmax(-1)

    m = Tagger().eval()
    x = torch.randn(3, 20, 8)
    with torch.no_grad():
        fast = opfuse.compile(m, (x,))
        assert_matches_eager(m, fast(x), (x,))
        report = opfuse.explain(m, (x,))
    assert report.kernels_after <= 3
    assert any(
        op in ("aten.gru.input", "aten.rnn_tanh.input") for g in report.groups for op in g.ops
    )


def test_lstm_runs_onednn_layers_next_to_a_gru() -> None:
    """A GRU sends capture down torch.export's decomposition path, which switches oneDNN
    off: the LSTM unrolled into a matmul and gates per step (8 kernels -> 70)."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True, bidirectional=True)
            self.gru = nn.GRU(32, 8, batch_first=True)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y, (h, _) = self.lstm(x)
            return self.gru(y)[0].tanh(), h.sum(0)

    m = Stack().eval()
    x = torch.randn(3, 7, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # nor torch.export's warning about RNN weights
        fast = opfuse.compile(m, (x,))
        assert_matches_eager(m, fast(x), (x,))
    ops = [op for g in fast.report.groups for op in g.ops]
    assert ops.count("aten.mkldnn_rnn_layer.default") == 4
    assert "aten.addmm.default" not in ops


def test_a_tensor_passed_twice_does_not_serve_two_tensors() -> None:
    # torch.export traces (x, x) as one input: the graph reads the first for both
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * 2 + b.sin()

    m = Two().eval()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    fast = opfuse.compile(m, (x, x))
    torch.testing.assert_close(fast(x, x), m(x, x))
    torch.testing.assert_close(fast(x, y), m(x, y))  # a new signature: compiled again
    strict = opfuse.compile(m, (x, x), recompile=False)
    with pytest.raises(opfuse.RecompileError, match="the same tensor as input 0"):
        strict(x, y)


def test_deepcopy_of_a_compiled_module_is_independent() -> None:
    class Steps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.lin(x).relu() * self.calls

    x = torch.randn(3, 4)
    fast = opfuse.compile(Steps().eval(), (x,))
    first = fast(x)
    twin = copy.deepcopy(fast)
    torch.testing.assert_close(twin(x), fast(x))  # both at their second call
    torch.testing.assert_close(fast(x), first * 3)
    torch.testing.assert_close(twin(x), first * 3)


def test_public_names_and_entry_points_resolve() -> None:
    """The package layout may move modules; what users import and what pip installs may not."""
    from importlib.metadata import entry_points

    from opfuse.report import FusionReport

    assert opfuse.FusionReport is FusionReport
    for name in opfuse.__all__:
        assert getattr(opfuse, name) is not None
    assert callable(opfuse.explain) and callable(opfuse.compile)
    scripts = {e.name: e for e in entry_points(group="console_scripts") if e.name == "opfuse"}
    backends = {e.name: e for e in entry_points(group="torch_dynamo_backends")}
    assert callable(scripts["opfuse"].load())
    assert callable(backends["opfuse"].load())


def test_reports_of_graphs_compiled_on_another_thread_are_collected() -> None:
    """Autograd runs a GPU graph's backward, and compiles it, on the device's own thread
    (an H200 run's training report missed every backward group): what collect_reports and
    explain gather comes from every thread."""
    import threading

    from opfuse.frontend import dynamo

    torch._dynamo.reset()
    f = torch.compile(lambda t: (t.sin() * 2).sum(1), backend="opfuse")
    with dynamo.listening() as reports:
        worker = threading.Thread(target=lambda: f(torch.randn(4, 8)))
        worker.start()
        worker.join()
    assert len(reports) == 1 and reports[0].groups
    f(torch.randn(4, 8))  # served from the cache: nothing is reported any more
    assert len(reports) == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled_under", ["autocast", "none"])
def test_a_call_under_another_autocast_state_computes_as_eager_does(compiled_under: str) -> None:
    """The capture traces under the autocast state of the compile (its graphs compute and
    return bfloat16 where autocast casts): a call under another state gets eager's dtypes
    and numerics for that state, through torch.compile."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        if compiled_under == "autocast":
            with bf16:
                fast = opfuse.compile(m, (x,))
                assert fast(x).dtype == torch.bfloat16  # as compiled: no detour
        else:
            fast = opfuse.compile(m, (x,))
        pipeline._warned.clear()
        with pytest.warns(RuntimeWarning, match="autocast"):
            if compiled_under == "autocast":
                out, want = fast(x), m(x)
            else:
                with bf16:
                    out, want = fast(x), m(x)
    assert (
        out.dtype
        == want.dtype
        == (torch.float32 if compiled_under == "autocast" else torch.bfloat16)
    )
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


def test_a_model_calling_its_own_compiled_module_raises_as_eager_recursion_would() -> None:
    """`model.forward = opfuse.compile(model, ...)`: a new shape compiles, which calls the
    model, which calls the compiled module again. Eager recurses forever; the compiled
    module says so instead of waiting on its own lock."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    compiled = opfuse.compile(model, (torch.randn(2, 4),))
    model.forward = compiled  # type: ignore[method-assign]
    got: list[BaseException] = []

    def call() -> None:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            try:
                compiled(torch.randn(3, 4))
            except RecursionError as e:
                got.append(e)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the call hung"
    assert got and "calls its own compiled module" in str(got[0])
