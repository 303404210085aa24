"""A compiled module follows its model's live parameters (as torch.compile does): every
change torch can see sends the next call through a new compile, and every path (folded,
prepacked, read in place, autograd, new shapes) then computes with the new values."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import opfuse
from tests.conftest import assert_matches_eager


class Net(nn.Module):
    """Weights every way a compile uses them: a conv with BatchNorm folded into it, a
    linear packed for the GEMM library, a tensor attribute and a buffer read in place."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 6 * 6, 10)
        self.scale = torch.rand(10) + 0.5  # a plain tensor attribute
        self.register_buffer("shift", torch.randn(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.flatten(1)) * self.scale + self.shift


def _net() -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    m = Net().eval()
    m.bn.running_mean.uniform_(-1, 1)
    m.bn.running_var.uniform_(0.5, 2)
    return m, torch.randn(4, 3, 6, 6)


def _compiles(fast: Any) -> int:
    return len(fast._entries)


CHANGES = {
    "add_ under no_grad": lambda m: m.conv.weight.add_(0.5),
    "bn statistics": lambda m: m.bn.running_var.mul_(3.0),
    "tensor attribute": lambda m: m.scale.mul_(-1.0),
    "buffer": lambda m: m.shift.fill_(2.0),
    "load_state_dict": lambda m: m.load_state_dict(_net()[0].state_dict() | _doubled(m)),
    "assign a new Parameter": lambda m: setattr(m.fc, "weight", nn.Parameter(m.fc.weight * 2)),
    "replace a tensor attribute": lambda m: setattr(m, "scale", m.scale * -1.0),
    "replace a submodule": lambda m: setattr(m, "fc", nn.Linear(8 * 6 * 6, 10)),
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(
        _doubled(m), strict=False, assign=True
    ),
}


def _doubled(m: nn.Module) -> dict[str, torch.Tensor]:
    return {"fc.weight": m.fc.weight.detach() * 2, "conv.bias": m.conv.bias.detach() + 1}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_parameter_reaches_every_path(change: str) -> None:
    m, x = _net()
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    with torch.no_grad():
        CHANGES[change](m)
    with pytest.warns(RuntimeWarning, match="since the model was compiled"):
        out = fast(x)
    assert_matches_eager(m, out, (x,))
    assert _compiles(fast) == 1
    assert_matches_eager(m, fast(x), (x,))  # no further compile: nothing changed since
    # a new shape and the autograd path see the same weights
    x2 = torch.randn(2, 3, 6, 6)
    assert_matches_eager(m, fast(x2), (x2,))
    xg = x.clone().requires_grad_()
    torch.testing.assert_close(fast(xg), m(xg))


SEQUENTIAL_CHANGES: dict[str, Callable[[nn.Sequential], Any]] = {
    "an activation swapped": lambda m: m.__setitem__(1, nn.ReLU()),
    "a layer deleted": lambda m: m.__delitem__(2),
    "a layer appended": lambda m: m.append(nn.Tanh()),
}


@pytest.mark.parametrize("change", sorted(SEQUENTIAL_CHANGES))
def test_a_changed_module_tree_is_followed(change: str) -> None:
    # a submodule without tensors moves no frozen tensor: the GELU swapped for a ReLU
    # kept computing GELU (0.67 off); a deletion moves no registration hook either
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16)).eval()
    x = torch.randn(5, 8)
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))
    SEQUENTIAL_CHANGES[change](m)
    with pytest.warns(RuntimeWarning, match="since the model was compiled"):
        out = fast(x)
    assert_matches_eager(m, out, (x,))
    assert fast._watch is not None and fast._watch.changed() is None


def test_an_optimizer_step_reaches_every_path() -> None:
    m, x = _net()
    fast = opfuse.compile(m, (x,))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(3):
        m.train()
        m(torch.randn(4, 3, 6, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        m.eval()
        if step == 0:  # warned once per compiled module
            with pytest.warns(RuntimeWarning, match="modified in place"):
                out = fast(x)
        else:
            out = fast(x)
        assert_matches_eager(m, out, (x,))


def test_nothing_changed_compiles_once_and_the_check_is_cheap() -> None:
    m, x = _net()
    fast = opfuse.compile(m, (x,))
    first = fast._first
    for _ in range(3):
        fast(x)
    assert fast._first is first and _compiles(fast) == 1
    assert fast._watch is not None and fast._watch.changed() is None
    # the state dict and the tensor attribute, but not what the graph never reads
    watched = set(fast._watch.names)
    assert watched == (set(m.state_dict()) | {"scale"}) - {"bn.num_batches_tracked"}


class _Dropped(Net):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(super().forward(x))


@pytest.mark.parametrize("switch", ["model", "submodule"])
def test_a_mode_changed_after_the_compile_is_followed(switch: str) -> None:
    """The graphs hold eval mode (BatchNorm folded, dropout gone): after model.train() (or
    one submodule's) calls compute as eager does in that mode, batch statistics and the
    running stats' update included; back in eval mode they run compiled again, from the
    updated running statistics."""
    from opfuse import pipeline

    m, x = _net()
    d = _Dropped()
    d.load_state_dict(m.state_dict())
    d.scale = m.scale
    d.eval()
    ref = copy.deepcopy(d)
    fast = opfuse.compile(d, (x,))
    fast(x)
    pipeline._warned.clear()
    for mod in (d, ref):
        (mod if switch == "model" else mod.bn).train()
    with pytest.warns(RuntimeWarning, match="training mode changed"):
        out = fast(x)
    ref.drop.p = 0.0  # its own random masks: compare with the kept elements, doubled
    kept = ref(x) * (2.0 if switch == "model" else 1.0)
    dropped = out == 0
    assert dropped.any() == (switch == "model")
    torch.testing.assert_close(out[~dropped], kept[~dropped])  # batch statistics
    torch.testing.assert_close(d.bn.running_mean, ref.bn.running_mean)
    d.eval()
    ref.eval()
    with pytest.warns(RuntimeWarning, match="modified in place"):
        out = fast(x)
    assert_matches_eager(ref, out, (x,))
    assert fast._entries  # compiled again


def test_the_modes_watched_are_those_a_forward_may_read() -> None:
    """torch's convolutions, linears and activations compute the same in either mode: a
    call checks the model's own mode and those of BatchNorm, dropout and the model's own
    classes only; a convolution put in training mode alone keeps the compiled path."""
    import warnings

    m, x = _net()
    d = _Dropped()
    d.load_state_dict(m.state_dict())
    d.scale = m.scale
    d.eval()
    fast = opfuse.compile(d, (x,))
    watched = fast.__dict__["_submodules"]
    assert watched == [d, d.bn, d.drop]
    d.conv.train()
    d.fc.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "training mode changed", no torch.compile
        assert_matches_eager(d, fast(x), (x,))
    from opfuse import pipeline

    pipeline._warned.clear()
    d.drop.train()
    with pytest.warns(RuntimeWarning, match="training mode changed"):
        fast(x)


class _HalvedInTraining(torch.nn.Conv2d):
    """A convolution of the model's own class that keeps torch's forward but overrides a
    method it calls, which reads the mode."""

    def _conv_forward(self, x, w, b):  # type: ignore[no-untyped-def]
        return super()._conv_forward(x, w * 0.5 if self.training else w, b)


def test_a_subclass_overriding_what_a_torch_forward_calls_has_its_mode_watched() -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(_HalvedInTraining(3, 4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    fast = opfuse.compile(m, (x,))
    assert m[0] in fast.__dict__["_submodules"]
    assert m[1] not in fast.__dict__["_submodules"]
    from opfuse import pipeline

    pipeline._warned.clear()
    m[0].train()
    with pytest.warns(RuntimeWarning, match="training mode changed"):
        out = fast(x)
    assert_matches_eager(m, out, (x,))


def test_writes_that_bypass_version_counters_in_place_need_refresh() -> None:
    m, x = _net()
    fast = opfuse.compile(m, (x,))
    fast(x)
    m.fc.weight.data.mul_(2.0)  # .data has a version counter of its own: unseen
    assert fast._watch is not None and fast._watch.changed() is None
    fast.refresh()
    assert_matches_eager(m, fast(x), (x,))


@pytest.mark.parametrize("entry", ["opfuse.compile", "torch.compile"])
def test_data_assigned_to_a_parameter_is_followed(entry: str) -> None:
    """`p.data = t` moves no version counter and runs no hook; the parameter's data address
    moves, which each call compares (in C: frontend/watch.Watched)."""
    m, x = _net()
    torch._dynamo.reset()
    fast = (
        opfuse.compile(m, (x,)) if entry == "opfuse.compile" else torch.compile(m, backend="opfuse")
    )
    with torch.no_grad():
        assert_matches_eager(m, fast(x), (x,))
        m.fc.weight.data = m.fc.weight.detach() * 2
        m.conv.weight.data = m.conv.weight.detach() * 0.5  # (folded with its BatchNorm)
        with pytest.warns(RuntimeWarning, match="compil"):
            out = fast(x)
        assert_matches_eager(m, out, (x,))
        assert_matches_eager(m, fast(x), (x,))
    torch._dynamo.reset()


def test_a_deep_copy_computes_with_its_own_weights() -> None:
    m, x = _net()
    fast = opfuse.compile(m, (x,))
    ref = fast(x).clone()
    twin = copy.deepcopy(fast)
    with torch.no_grad():
        twin._model.fc.weight.mul_(3.0)  # an EMA update of the copy
    with pytest.warns(RuntimeWarning, match="fc.weight was modified in place"):
        out = twin(x)
    assert_matches_eager(twin._model, out, (x,))
    torch.testing.assert_close(fast(x), ref)  # the original is untouched
    assert_matches_eager(m, fast(x), (x,))
    # and the copy's shared kernels follow a change of the original's weights
    twin2 = copy.deepcopy(fast)
    with torch.no_grad():
        m.conv.weight.mul_(2.0)
    with pytest.warns(RuntimeWarning, match="copied from"):
        out = twin2(x)
    assert_matches_eager(twin2._model, out, (x,))
    with pytest.warns(RuntimeWarning, match="conv.weight was modified in place"):
        assert_matches_eager(m, fast(x), (x,))


class Counter(nn.Module):
    """Updates a buffer in place on every call (eager mutates the model's)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.lin(x) * self.calls


def test_an_updated_buffer_is_one_state_across_shapes_and_recompiles() -> None:
    torch.manual_seed(0)
    m = Counter().eval()
    ref = copy.deepcopy(m)
    fast = opfuse.compile(m, (torch.randn(2, 4),))
    for n in (2, 3, 2, 5):
        x = torch.randn(n, 4)
        torch.testing.assert_close(fast(x), ref(x))
    with torch.no_grad():
        m.lin.weight.add_(1.0)
        ref.lin.weight.add_(1.0)
    x = torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match="modified in place"):
        torch.testing.assert_close(fast(x), ref(x))
    assert float(m.calls) == 0  # the caller's module is not modified


def test_a_module_compiled_without_recompiling_still_follows_its_parameters() -> None:
    m, x = _net()
    fast = opfuse.compile(m, (x,), recompile=False)
    with torch.no_grad():
        m.fc.bias.add_(1.0)
    with pytest.warns(RuntimeWarning, match="fc.bias was modified in place"):
        out = fast(x)
    assert_matches_eager(m, out, (x,))
    with pytest.raises(opfuse.RecompileError, match="shape"):
        fast(torch.randn(2, 3, 6, 6))


def test_modules_built_inside_a_compiled_forward_do_not_recompile_it() -> None:
    """opfuse's registration hooks are process-wide: a forward that slices a ModuleList
    (a new one, its modules registered) must not make dynamo guard on them and recompile
    on every call -- for opfuse's backend or any other."""

    class Sliced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for lin in self.layers[:-1]:
                x = torch.relu(lin(x))
            return self.layers[-1](x)

    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(1)
        return gm.forward

    torch._dynamo.reset()
    m = Sliced().eval()
    f = torch.compile(m, backend=counting)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(f(x), m(x))
    assert len(graphs) == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_torch_compile_inference_freezes_parameters_and_follows_them(change: str) -> None:
    """Under torch.compile an inference graph takes its parameters as constants (BatchNorm
    folded, convolutions prepacked, as opfuse.compile does) while the same tensors come
    unchanged; any change torch sees, or a `p.data = t`, compiles it again."""
    from opfuse.frontend import dynamo

    m, x = _net()
    torch._dynamo.reset()
    f = torch.compile(m, backend="opfuse")
    with torch.no_grad(), dynamo.listening() as reports:
        assert_matches_eager(m, f(x), (x,))
        assert reports[-1].folds  # the BatchNorm folded into the convolution
        before = dynamo.compiles()
        assert_matches_eager(m, f(x), (x,))
        assert dynamo.compiles() == before
        CHANGES[change](m)
        with pytest.warns(RuntimeWarning, match="compiling it again"):
            out = f(x)
        assert_matches_eager(m, out, (x,))
        m.conv.weight.data = m.conv.weight.detach() * 0.5
        assert_matches_eager(m, f(x), (x,))
        m.fc.weight.data.mul_(2.0)  # unseen by any counter: opfuse.refresh()
        opfuse.refresh()
        assert_matches_eager(m, f(x), (x,))
    torch._dynamo.reset()


def test_torch_compile_inference_stops_freezing_parameters_that_keep_changing() -> None:
    from opfuse.frontend import dynamo

    m, x = _net()
    torch._dynamo.reset()
    f = torch.compile(m, backend="opfuse")
    with torch.no_grad(), pytest.warns(RuntimeWarning) as seen:
        for _ in range(dynamo.FREEZE_CHANGES + 2):
            assert_matches_eager(m, f(x), (x,))
            m.fc.weight.mul_(0.9)
    assert any("now reads them as inputs" in str(w.message) for w in seen)
    before = dynamo.compiles()
    with torch.no_grad():
        m.fc.weight.mul_(0.9)
        assert_matches_eager(m, f(x), (x,))
    assert dynamo.compiles() == before
    torch._dynamo.reset()


def test_refresh_forgets_folds_another_compile_still_holds() -> None:
    """A BatchNorm fold is shared by every compile that folds the same tensors alike, found
    by their storage, address and version counter: after a `p.data` write, which moves
    none of them, opfuse.refresh() must forget it too, or a torch.compile graph compiled
    again finds the fold an opfuse.compile of the same model still holds (2.4 off)."""

    m, x = _net()
    held = opfuse.compile(m, (x,))
    torch._dynamo.reset()
    f = torch.compile(m, backend="opfuse")
    with torch.no_grad(), pytest.warns(RuntimeWarning):
        assert_matches_eager(m, f(x), (x,))
        m.conv.weight.data.mul_(2.0)
        opfuse.refresh()
        assert_matches_eager(m, f(x), (x,))
    assert held is not None
    torch._dynamo.reset()


def test_an_eval_model_called_with_grad_gets_eagers_parameter_gradients() -> None:
    """An eval-mode model trained or probed with gradients (BatchNorm frozen): eager's
    outputs require grad through the parameters, and so do the compiled module's, whose
    backward runs eager's again; under no_grad nothing is recorded. Outputs that are views
    of one another run through torch.compile, which records them as eager does."""
    m, x = _net()
    fast = opfuse.compile(m, (x,))
    ref = copy.deepcopy(m)
    out, want = fast(x), ref(x)
    assert out.requires_grad and want.requires_grad
    assert_matches_eager(ref, out.detach(), (x,))
    out.add_(1)  # an output is the caller's to write to, as eager's is
    (out * out).sum().backward()
    ((want + 1) * (want + 1)).sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert not fast(x).requires_grad


class _Returns(nn.Module):
    """A linear layer whose forward returns `how(y, x)` of its result y and its input x:
    the outputs' shapes of sharing each gradient test needs."""

    def __init__(self, how: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.how = how

    def forward(self, x: torch.Tensor) -> Any:
        return self.how(self.lin(x), x)


def test_with_grad_only_outputs_that_depend_on_parameters_require_grad() -> None:
    def mixed(y: torch.Tensor, x: torch.Tensor) -> Any:
        y = y.relu()
        return y.t(), x.sin() * 2, y.argmax(-1)

    m = _Returns(mixed).eval()
    x = torch.randn(4, 8)
    fast = opfuse.compile(m, (x,))
    got, want = fast(x), m(x)
    assert [t.requires_grad for t in got] == [t.requires_grad for t in want] == [True, False, False]
    assert got[0].stride() == want[0].stride()  # a view output, copied as it was laid out
    got[0].add_(1)  # in place, as eager's allows
    got[0].sum().backward()
    g = m.lin.weight.grad.clone()
    m.zero_grad()
    want[0].sum().backward()
    torch.testing.assert_close(g, m.lin.weight.grad)
    m.lin.requires_grad_(False)
    assert not any(t.requires_grad for t in fast(x))


def test_views_among_the_outputs_with_grad_run_through_torch_compile() -> None:
    def views(y: torch.Tensor, x: torch.Tensor) -> Any:
        y = y * 2
        return y, y.view(-1)

    two = _Returns(views).eval()
    ref = copy.deepcopy(two)
    x = torch.randn(4, 8)
    fast = opfuse.compile(two, (x,))
    a, b = fast(x)
    b.add_(1)  # in place on a view output, as eager allows
    a.sum().backward()
    ra, rb = ref(x)
    rb.add_(1)
    ra.sum().backward()
    torch.testing.assert_close(two.lin.weight.grad, ref.lin.weight.grad)
    assert fast._grads.shared  # later calls go there without running the graph
    assert_matches_eager(ref, tuple(t.detach() for t in fast(x)), (x,))


def test_a_frozen_graph_keys_calls_by_its_live_inputs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's signature leaves out the frozen parameters (the watch already holds them
    the same, unchanged): keying MobileNetV2's 262 of them cost 0.35 ms a call."""
    from opfuse.frontend import dynamo

    m, x = _net()
    torch._dynamo.reset()
    seen: list[Any] = []
    real = dynamo._unit_strides
    monkeypatch.setattr(dynamo, "_unit_strides", lambda t: seen.append(t) or real(t))
    f = torch.compile(m, backend="opfuse")
    with torch.no_grad():
        f(x)
        seen.clear()
        assert_matches_eager(m, f(x), (x,))
    assert [t is x for t in seen] == [True]  # the input alone
    torch._dynamo.reset()


def test_instances_of_one_model_class_keep_their_own_frozen_compiles() -> None:
    """dynamo hands every instance of a class the same graph, the parameters as inputs:
    each instance's are compiled in apart and called alternately without compiling again
    (they counted as changed parameters, and after FREEZE_CHANGES the graph stopped
    freezing them)."""
    import warnings

    from opfuse.frontend import dynamo

    torch.manual_seed(0)
    a, x = _net()
    b = _net()[0]
    with torch.no_grad():
        b.fc.weight.add_(1)  # (its own weights)
    torch._dynamo.reset()
    fa, fb = torch.compile(a, backend="opfuse"), torch.compile(b, backend="opfuse")
    before = dynamo.compiles()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(dynamo.FREEZE_CHANGES + 2):
            assert_matches_eager(a, fa(x), (x,))
            assert_matches_eager(b, fb(x), (x,))
        b.fc.weight.mul_(0.9)  # a change of one instance's is still followed
        assert_matches_eager(a, fa(x), (x,))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="changed"):
        assert_matches_eager(b, fb(x), (x,))
    assert dynamo.compiles() - before == 3
    torch._dynamo.reset()


def test_a_deep_copy_with_grad_differentiates_its_own_parameters() -> None:
    """A deep copy's graphs hold the original's tensors until either changes: which of its
    outputs need grad is found by parameter name, and its backward is its own model's."""
    m, x = _net()
    fast = opfuse.compile(m, (x,))
    fast(x)
    twin = copy.deepcopy(fast)
    out = twin(x)
    assert out.requires_grad
    out.sum().backward()
    own = twin.__dict__["_model"]
    want = copy.deepcopy(own)
    want.zero_grad()
    want(x).sum().backward()
    torch.testing.assert_close(own.fc.weight.grad, want.fc.weight.grad)
    assert m.fc.weight.grad is None  # the original's untouched


def test_one_tensor_returned_twice_with_grad_is_one_output() -> None:
    """hidden_states[-1] is last_hidden_state: the same tensor in two places stays one
    tensor (no fallback to torch.compile), its gradient as eager's."""

    def twice(y: torch.Tensor, x: torch.Tensor) -> Any:
        y = y.tanh()
        return {"last": y, "all": (x, y)}

    m = _Returns(twice).eval()
    ref = copy.deepcopy(m)
    x = torch.randn(4, 8)
    fast = opfuse.compile(m, (x,))
    out, want = fast(x), ref(x)
    assert out["last"] is out["all"][1] and out["last"].requires_grad
    assert not fast._grads.shared
    (out["last"] * 2 + out["all"][1]).sum().backward()
    (want["last"] * 2 + want["all"][1]).sum().backward()
    torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad)


def test_version_sum_in_c_follows_every_counter_and_skips_inference_tensors() -> None:
    from opfuse.frontend import watch

    plain = [torch.randn(3) for _ in range(5)]
    with torch.inference_mode():
        frozen = torch.randn(3)
    watched = watch.Watched([*plain, frozen])
    if watch._helpers() is not None:  # where the helper builds, it is the one used
        assert watched.sum_fn is not None
    start = watched.version()
    assert start == sum(t._version for t in plain)
    plain[2].add_(1)
    plain[4].mul_(2)
    assert watched.version() == start + 2
    with torch.inference_mode():
        frozen.add_(1)  # in place inside inference mode: untracked, as in torch
    assert watched.version() == start + 2
    assert not watched.moved()


def test_addresses_in_c_see_data_moved_and_nothing_else() -> None:
    """Watched compares each tensor's data address (storage offset included) in C:
    `.data = t` and `set_` move it, in-place writes do not; views, empty and inference
    tensors compare as data_ptr does."""
    from opfuse.frontend import watch

    base = torch.randn(10)
    with torch.inference_mode():
        frozen = torch.randn(3)
    p = torch.nn.Parameter(torch.randn(4))
    tensors = [base[3:7], torch.empty(0), frozen, p, torch.randn(2, 3).t()]
    addressed = watch.Watched(tensors)
    if watch._helpers() is not None:
        assert addressed.moved_fn is not None
    assert not addressed.moved()
    base.add_(1)
    p.data.mul_(2)
    assert not addressed.moved()
    p.data = torch.randn(4)
    assert addressed.moved()
    p.data = tensors[3].detach()  # (the same tensor object's data, new storage again)
    assert addressed.moved()
    t = torch.randn(4)
    other = watch.Watched([t])
    t.set_(torch.randn(4))
    assert other.moved()


def _built_in_inference_mode() -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    with torch.inference_mode():
        mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
        conv = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 6 * 6, 10),
            nn.LayerNorm(10),
        ).eval()
    return mlp, conv, torch.randn(2, 8), torch.randn(2, 3, 6, 6)


@pytest.mark.parametrize("entry", ["compile", "torch.compile"])
def test_a_model_built_under_inference_mode_compiles(entry: str) -> None:
    # Its parameters are inference tensors: torch.export refused them outside inference
    # mode and the parameter watch could not read their (missing) version counters, so
    # opfuse fused nothing; under grad the replay for double backward raised.
    mlp, conv, x, img = _built_in_inference_mode()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback on the way
        for m, given in ((mlp, x), (conv, img)):
            with torch.no_grad():
                fast = (
                    opfuse.compile(m, (given,))
                    if entry == "compile"
                    else torch.compile(m, backend="opfuse")
                )
                assert_matches_eager(m, fast(given), (given,))
            with torch.inference_mode():
                assert_matches_eager(m, fast(given), (given,))
            if entry == "compile":
                assert any(g.pattern.value != "fallback" for g in fast.report.groups)
    if entry == "compile":
        # with grad, as eager runs it (a linear saves no inference tensor for backward);
        # torch.compile's AOTAutograd saves them and raises, under inductor too
        fast = opfuse.compile(mlp, (x,))
        assert_matches_eager(mlp, fast(x).detach(), (x,))
