"""Model -> opfuse Graph of ATen ops. With decompose.py (the decomposition table and the
op-by-op retrace), the only modules that touch torch.export and torch.fx.

Two doors lead in:
- `capture_module` (opfuse.compile, eval mode): torch.export traces the model to core
  ATen; parameters and buffers are frozen into the graph as constants.
- `convert.capture_fx` (torch.compile backend, training): AOTAutograd hands us forward and
  backward ATen graphs whose parameters are ordinary inputs.
Both become opfuse's Graph in convert.py.

Both decompose composite ops (layer_norm, softmax, group_norm, batch_norm in training) into
reductions and pointwise ops, which the fusion pass then regroups; inference BatchNorm is
kept whole so that `rewrite.fold_batchnorm` can fold it into the conv before it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..ir.graph import Graph
from . import sizes, structure
from .convert import ASSERTIONS, CaptureError, convert, propagate
from .decompose import (
    CALLER_ONEDNN,
    RECURRENT,
    decompositions,
    keep_whole,
    shape_env_state,
    symbolic_mode,
)

aten = torch.ops.aten


@dataclass
class Captured:
    """A captured model: its Graph and how runtime values map onto it."""

    graph: Graph
    # Per graph output: ('user', i) a user-visible tensor leaf, ('input', k) the new value of
    # user input k (eager mutated it in place), ('state', name) the new value of a buffer.
    output_roles: list[tuple[str, Any]] = field(default_factory=list)
    out_spec: structure.Spec | None = None
    # Per graph input: ('user', k) flattened user input k, ('state', name) mutable buffer.
    input_roles: list[tuple[str, Any]] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # private mutable buffers
    scalar_inputs: dict[int, Any] = field(default_factory=dict)  # user leaf k -> value
    eager_kernels: int | None = None  # compute ops eager runs (before decomposition)
    # The model's tensors the graph holds as constants, by qualified name (watch.py)
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)
    dynamic: str = ""  # captured from an export with symbolic sizes: which, and how


# -- eval-mode capture through torch.export ------------------------------------------
class _Flat(torch.nn.Module):
    """Calls the model and returns its tensor leaves as a flat tuple (records the spec)."""

    def __init__(self, model: torch.nn.Module, box: list[structure.Spec]) -> None:
        super().__init__()
        self.m = model
        # The spec goes into a list created outside: export restores module attributes
        # that forward() assigns.
        self._box = box

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        leaves, spec = structure.flatten(self.m(*args, **kwargs))
        self._box.append(spec)
        return tuple(leaves)


@dataclass
class Exported:
    """A model traced by torch.export (and decomposed), before its capture at some sizes."""

    program: Any  # the ExportedProgram
    spec: structure.Spec  # the structure of the model's outputs
    eager_kernels: int  # compute ops eager runs (before decomposition)
    symbolic: bool = False  # some input sizes are symbols (dynamic_shapes)
    # Per graph output: the strides eager returns it with (before decomposition), where
    # static and dense; the captured graph copies an output whose decomposition changed them.
    strides: tuple[tuple[int, ...] | None, ...] = ()


def capture_module(
    model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None = None
) -> Captured:
    """Trace `model(*args, **kwargs)` with torch.export and freeze its parameters."""
    kwargs = kwargs or {}
    return capture_exported(export_model(_Flat, model, args, kwargs), args, kwargs)


# Where torch.export meets data-dependent control flow it logs a warning here and prints
# the partial graph to stderr (30 lines for a 3-op model, twice) before raising what
# opfuse reports in one warning.
_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes",)


@contextlib.contextmanager
def _quiet(names: Sequence[str]) -> Iterator[None]:
    """torch's loggers `names` at ERROR, and stderr held, for the block: what was written
    there goes out after it, less the partial graphs of a failed export."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    held = io.StringIO()
    failed: BaseException | None = None
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException as e:
        failed = e
        raise
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        text = held.getvalue()
        graph = getattr(failed, "partial_fx_graph", None)
        if graph is not None:
            text = text.replace(f"{graph}\n", "")
        if text.strip():
            sys.stderr.write(text)


def _short(e: BaseException) -> str:
    """An export error in a line or two: its first line, and the model's line that raised it
    where torch names it (its message goes on with debugging advice for torch.export)."""
    lines = str(e).splitlines()
    first = lines[0] if lines else type(e).__name__
    marker = "The following call raised this error:"
    if marker in lines:
        i = lines.index(marker)
        at = []
        for ln in lines[i + 1 : i + 3]:
            if not ln.strip():
                break
            at.append(ln.strip())
        if at:
            return f"{first} ({' '.join(at)})"
    return first


def export_model(
    wrapper: Callable[[torch.nn.Module, list[structure.Spec]], torch.nn.Module],
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
) -> Exported:
    """torch.export of `wrapper(model, box)` (which flattens the model's outputs and
    records their structure in box), decomposed to the ops opfuse fuses."""
    box: list[structure.Spec] = []
    CALLER_ONEDNN.set(torch._C._get_mkldnn_enabled())

    # A model built under torch.inference_mode holds inference tensors, which export's
    # fake copies may not mark requires_grad outside that mode: traced inside it.
    inference = any(t.is_inference() for t in (*model.parameters(), *model.buffers()))

    def export() -> Any:
        module, given = wrapper(model, box), (tuple(args), kwargs or {})
        with torch.inference_mode() if inference else contextlib.nullcontext():
            return torch.export.export(module, *given, strict=False, dynamic_shapes=dynamic_shapes)

    try:
        with warnings.catch_warnings(), _quiet(_EXPORT_LOGGERS):
            # torch.export's internals raise deprecation warnings users cannot act on, and
            # warn that nn.RNN modules refresh their weight list while traced.
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", "The tensor attributes .* were assigned during")
            ep: Any = export()
            eager_kernels = count_eager_kernels(ep.graph_module)
            strides = _output_strides(ep.graph_module)
            mode = symbolic_mode(ep.graph_module)
            learnt = shape_env_state(mode) if mode is not None else None
            gm = _decompose_functional(ep.graph_module)
            if gm is None:
                if mode is not None and shape_env_state(mode) != learnt:
                    # The retrace it refused left guards in the export's sizes (one may
                    # have made the batch a constant): decompose a fresh export instead.
                    ep = export()
                with keep_whole():
                    ep = ep.run_decompositions(decompositions())
            else:
                ep = _Retraced(ep, gm)
    except Exception as e:  # export fails for many reasons; callers fall back to dynamo
        raise CaptureError(
            f"torch.export could not trace the model: {type(e).__name__}: {_short(e)}"
        ) from e
    symbolic = any(
        isinstance(v, torch.Tensor) and sizes.has_symbolic_sizes(v)
        for v in (n.meta.get("val") for n in ep.graph_module.graph.find_nodes(op="placeholder"))
    )
    return Exported(ep, box[-1], eager_kernels, symbolic, strides)


def _output_strides(gm: torch.fx.GraphModule) -> tuple[tuple[int, ...] | None, ...]:
    """Per output of an exported graph, its strides where they are static and dense.

    Decompositions may return another layout than the op eager runs (a circular pad's
    concatenations keep a channels-last input's layout; torch's pad returns contiguous):
    the caller must still get eager's."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense_layout

    out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    found: list[tuple[int, ...] | None] = []
    for o in out if isinstance(out, (tuple, list)) else (out,):
        v = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
        if (
            isinstance(v, torch.Tensor)
            and not sizes.has_symbolic_sizes(v)
            and all(isinstance(s, int) for s in v.stride())
            and dense_layout(v)
        ):
            found.append(tuple(v.stride()))
        else:
            found.append(None)
    return tuple(found)


class _Retraced:
    """An ExportedProgram whose graph module was decomposed op by op: the program's
    signature and tensors with the new graph."""

    def __init__(self, ep: Any, gm: torch.fx.GraphModule) -> None:
        self.graph_signature = ep.graph_signature
        self.state_dict = ep.state_dict
        self.constants = ep.constants
        self.range_constraints = ep.range_constraints
        self.graph_module = gm
        # same inputs in the same order, new names
        old = [n.name for n in ep.graph_module.graph.find_nodes(op="placeholder")]
        new = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        self.renamed = dict(zip(old, new, strict=True))


def capture_exported(exported: Exported, args: Sequence[Any], kwargs: dict[str, Any]) -> Captured:
    """The exported model captured for `args` and `kwargs`: parameters frozen, and, where
    the export has symbolic sizes, every size it knows as an expression of them a Size
    (frontend/sizes.py) at these inputs' values."""
    ep, gm = exported.program, exported.program.graph_module
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    mutated = set(sig.buffers_to_mutate.values())
    user_leaves = pytree.tree_leaves((tuple(args), kwargs))
    values: list[Any] = []  # per graph input, in order: what a call passes

    placeholders: dict[str, Any] = {}
    input_roles: list[tuple[str, Any]] = []
    state: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    user_k = 0
    scalar_inputs: dict[int, Any] = {}
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            value = user_leaves[user_k]
            values.append(value)
            if isinstance(value, torch.Tensor):
                placeholders[name] = ("input", ("user", user_k))
            else:
                scalar_inputs[user_k] = value
                placeholders[name] = ("value", value)
            user_k += 1
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            target = spec.target
            tensor = lifted(ep, target)
            values.append(tensor)
            if target in mutated:
                # A buffer the model updates in place: the compiled module keeps its own copy.
                state[target] = tensor.detach().clone()
                placeholders[name] = ("input", ("state", target))
            else:
                placeholders[name] = ("constant", (strip(target), tensor.detach()))
                frozen[strip(target)] = tensor
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            tensor = lifted(ep, spec.target)
            values.append(tensor)
            placeholders[name] = ("constant", (strip(spec.target), tensor))
            frozen[strip(spec.target)] = tensor
        else:
            raise CaptureError(f"unsupported graph input kind {spec.kind}")

    if isinstance(ep, _Retraced):
        placeholders = {ep.renamed[a]: p for a, p in placeholders.items()}
    if exported.symbolic:
        vals = propagate(gm, values)
        _check_asserts(gm, vals)
        symbols = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
        binding = sizes.bind(symbols, values)
        graph, _ = convert(gm, placeholders, input_roles, vals, (), binding, exported.strides)
    else:
        graph, _ = convert(gm, placeholders, input_roles, strides=exported.strides)
    # Only what the graph reads can make a change matter (BatchNorm's num_batches_tracked
    # is no input of an eval graph: a sixth of MobileNetV2's tensors)
    used = {_place(c) for c in graph.constants.values() if isinstance(c, torch.Tensor)}
    frozen = {k: t for k, t in frozen.items() if _place(t) in used}
    output_roles: list[tuple[str, Any]] = []
    user_out = 0
    for spec in sig.output_specs:
        if spec.kind == OutputKind.USER_OUTPUT:
            output_roles.append(("user", user_out))
            user_out += 1
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            output_roles.append(("state", spec.target))
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            k = _user_input_position(sig, spec.target)
            output_roles.append(("input", k))
        else:
            raise CaptureError(f"unsupported graph output kind {spec.kind}")
    return Captured(
        graph,
        output_roles,
        exported.spec,
        input_roles,
        state,
        scalar_inputs,
        exported.eager_kernels,
        frozen,
    )


def _check_asserts(gm: torch.fx.GraphModule, vals: dict[torch.fx.Node, Any]) -> None:
    """The run-time assertions torch.export left in a graph with symbolic sizes (what it
    assumed of them that a range does not say), evaluated at this call's sizes."""
    for n in gm.graph.find_nodes(op="call_function", target=aten._assert_scalar.default):
        cond = n.args[0]
        if isinstance(cond, torch.fx.Node) and not vals.get(cond, True):
            raise CaptureError(f"these sizes break what the export assumed: {n.args[1]}")


def _decompose_functional(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """Decompose an exported graph that mutates nothing, op by op (decompose.retrace: fake
    tensors, same inputs and outputs, node metadata kept). None when the graph or its
    decomposition mutates, or holds higher-order ops: those need `run_decompositions`,
    which functionalizes and rewrites the signature, at four times the cost of a retrace
    (BERT-base: 2.3 s vs 0.6 s) and 15 times that of this one."""
    if not _plain_functional(gm) or any(n.target in RECURRENT for n in gm.graph.nodes):
        return None  # (make_fx decomposes every composite op; these must stay whole)
    from torch._dispatch.python import enable_python_dispatcher

    from .decompose import retrace

    vals = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None  # a scalar input: run_decompositions knows how it was specialised

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        # The Python dispatcher routes eval BatchNorm to the op `fold_batchnorm` matches,
        # as run_decompositions does.
        with enable_python_dispatcher(), keep_whole():
            yield

    try:
        out = retrace(gm, decompositions(listed=False), context)
    except Exception:
        return None
    return out if out is not None and _plain_functional(out) else None


def _plain_functional(gm: torch.fx.GraphModule) -> bool:
    """Only ATen ops that write nothing (and getitem, and the arithmetic on sizes a
    symbolic trace records); no submodules."""
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            return False
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if not isinstance(n.target, torch._ops.OpOverload):
            if _size_arithmetic(n):
                continue
            return False
        if n.target._schema.is_mutable:
            return False
    return True


_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _size_arithmetic(n: torch.fx.Node) -> bool:
    """A node computing a number from sizes (`s0 * 7`, `sym_max`): capture takes its value
    at each call's sizes, whatever function it is."""
    module = getattr(n.target, "__module__", None)
    return isinstance(n.meta.get("val"), _SCALARS) and module in ("_operator", "torch", "math")


def count_eager_kernels(gm: torch.fx.GraphModule) -> int:
    """Ops eager launches a kernel for: ATen ops that are not views (an in-place op writes,
    so it counts; a view only aliases)."""
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if str(node.target) in ASSERTIONS:
            continue
        returns = node.target._schema.returns
        aliases = [r.alias_info for r in returns if r.alias_info is not None]
        if aliases and not any(a.is_write for a in aliases):
            continue
        if not returns:
            continue
        n += 1
    return n


def _user_input_position(sig: Any, name: str) -> int:
    from torch.export.graph_signature import InputKind

    k = 0
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            if spec.arg.name == name:
                return k
            k += 1
    raise CaptureError(f"mutated input {name} not found")


def _place(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Where a tensor's elements are: a constant the graph holds is a detached alias of
    the model's tensor, at the same place."""
    return t.data_ptr(), tuple(t.shape), tuple(t.stride())


def lifted(ep: Any, target: str) -> torch.Tensor:
    """The tensor an export lifted to a graph input under `target` (a parameter, buffer or
    constant)."""
    return ep.state_dict[target] if target in ep.state_dict else ep.constants[target]


def strip(target: str) -> str:
    """A parameter's name in the model, from its name in a wrapper's export."""
    return target[2:] if target.startswith("m.") else target


def module_calls_fx(module: torch.nn.Module) -> list[tuple[str, str | None, int]] | None:
    """Submodule calls found by torch.fx symbolic tracing: (called module, the module whose
    output it reads directly or None, how many users its output has). None if the model
    cannot be traced symbolically."""
    try:
        gm = torch.fx.symbolic_trace(module)
    except Exception:
        return None
    calls: list[tuple[str, str | None, int]] = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            a = n.args[0] if n.args else None
            src = a.target if isinstance(a, torch.fx.Node) and a.op == "call_module" else None
            calls.append((str(n.target), str(src) if src is not None else None, len(n.users)))
    return calls


# -- AOTAutograd graphs (torch.compile backend) -----------------------------------------


__all__ = ["CaptureError", "Captured", "capture_module"]
