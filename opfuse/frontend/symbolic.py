"""opfuse.compile over inputs whose sizes vary: one torch.export with symbolic sizes, captured
at each new call's sizes.

A compiled module called with a second input shape that differs from the first only in the
sizes of its tensors exports the model once more, with the dims that changed as
`Dim.AUTO` (or it exports with the caller's `dynamic_shapes` from the start). Every later
shape that export admits is captured from it at its own sizes (capture.capture_exported):
each size the export knows as an expression of its symbols becomes an `ir.size.Size`, so
the sizes share their C builds, tuning and packed weights, and none exports again.

A shape is admitted when each input's sizes and strides are what the export's expressions
give for the symbols bound by the bare ones, within the ranges the export recorded, and
the assertions it left in the graph hold (capture._check_asserts). Anything else compiles
as its own static export.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..ir.size import PREFIX
from ..options import Options
from . import sizes, structure
from .capture import (
    Captured,
    CaptureError,
    Exported,
    capture_exported,
    export_model,
    lifted,
    strip,
)
from .dynamic import install, split_static, static_share

_ASSERT = torch.ops.aten._assert_scalar.default
DimSpec = dict[int, Any] | None  # per tensor leaf: its symbolic dims (torch.export.Dim)


class _Leaves(torch.nn.Module):
    """Calls the model with inputs given as the leaves of (args, kwargs) and returns its
    tensor leaves flat (recording their structure in box): dims given per leaf, whatever
    the model's signature."""

    def __init__(
        self, model: torch.nn.Module, box: list[structure.Spec], spec: pytree.TreeSpec
    ) -> None:
        super().__init__()
        self.m = model
        self._box = box  # in a list created outside: export restores module attributes
        self._spec = spec

    def forward(self, *leaves: Any) -> tuple[torch.Tensor, ...]:
        args, kwargs = pytree.tree_unflatten(list(leaves), self._spec)
        out, spec = structure.flatten(self.m(*args, **kwargs))
        self._box.append(spec)
        return tuple(out)


@dataclass
class Family:
    """One export with symbolic sizes and the shapes it serves."""

    exported: Exported
    dims: list[DimSpec]  # per leaf: the dims asked to be symbolic
    inputs: list[Any]  # per leaf: the export's input (a fake tensor, or the value)
    note: str  # for the report: which sizes are symbols, which the export fixed and why
    frozen: dict[str, torch.Tensor]  # the model's tensors it reads, by qualified name
    # The export's graph run once for every shape it admits: its static regions compiled
    # once, the ops sized by a symbol with torch (make_generic); None: per shape.
    generic: Callable[..., Any] | None = None

    def admits(self, leaves: Sequence[Any]) -> bool:
        """Does the export hold for inputs `leaves`?"""
        if len(leaves) != len(self.inputs):
            return False
        binding = sizes.bind(self.inputs, leaves)
        for want, got in zip(self.inputs, leaves):
            if isinstance(want, torch.Tensor) != isinstance(got, torch.Tensor):
                return False
            if not isinstance(want, torch.Tensor):
                if type(want) is not type(got) or want != got:
                    return False
                continue
            kind = (want.dtype, want.device.type, want.dim())
            if kind != (got.dtype, got.device.type, got.dim()):
                return False
            pairs = zip((*want.shape, *want.stride()), (*got.shape, *got.stride()))
            if any(sizes.value_of(w, binding) != g for w, g in pairs):
                return False
        ranges = self.exported.program.range_constraints
        for symbol, bounds in ranges.items():
            value = binding.get(str(symbol))
            if value is not None and not (bounds.lower <= value <= bounds.upper):
                return False
        return True

    def make_generic(self, options: Options) -> str | None:
        """Compile the export once for every shape when most of its work has static sizes
        (a decode step: all but attention over the cache), as the torch.compile backend
        does (frontend/dynamic.py); the note for the report, or None (per shape)."""
        from .dynamo import GENERIC_SHARE, compile_regions

        ep = self.exported.program
        sig = ep.graph_signature
        if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
            return None  # (what a generic run would have to write back)
        gm = ep.graph_module
        share = static_share(gm)
        if share < GENERIC_SHARE:
            return None
        from torch.export.graph_signature import InputKind

        user = _user_inputs(ep)
        state = [
            None if s.kind == InputKind.USER_INPUT else lifted(ep, s.target)
            for s in sig.input_specs
        ]
        split = split_static(gm, [i for i, t in enumerate(state) if t is not None])
        unfrozen = replace(options, freeze=False)  # the weights are the regions' inputs
        install(split, compile_regions(split.regions, unfrozen, split.static))
        run = split.module.forward

        def generic(leaves: Sequence[Any]) -> Any:
            values = list(state)
            for i, leaf in zip(user, leaves):
                values[i] = leaf
            outs = run(*values)
            spec = _evaluated(self.exported.spec, sizes.bind(self.inputs, leaves))
            return structure.unflatten(spec, list(outs))

        self.generic = generic
        return (
            f"{share:.0%} of the export's ops have static sizes: its {len(split.regions)} "
            "static regions compiled once serve every shape it admits, with no compile per "
            f"shape; {len(split.dynamic_ops)} ops sized by a symbol run with torch"
        )

    def asserts(self) -> bool:
        """Does the export assert anything of the sizes at run time (what capture checks
        at each shape, capture._check_asserts)? Such shapes are captured, never served."""
        gm = self.exported.program.graph_module
        return bool(gm.graph.find_nodes(op="call_function", target=_ASSERT))

    def values(self, leaves: Sequence[Any]) -> dict[str, int]:
        """The size symbols' values at `leaves` (admitted ones), by their C names."""
        return {PREFIX + k: v for k, v in sizes.bind(self.inputs, leaves).items()}

    def out_spec(self, leaves: Sequence[Any]) -> structure.Spec:
        """The structure of the outputs at `leaves`' sizes."""
        return _evaluated(self.exported.spec, sizes.bind(self.inputs, leaves))

    def capture(self, leaves: Sequence[Any]) -> Captured:
        """The export captured at `leaves`' sizes (admitted ones)."""
        captured = capture_exported(self.exported, tuple(leaves), {})
        captured.dynamic = self.note
        assert captured.out_spec is not None
        captured.out_spec = _evaluated(captured.out_spec, sizes.bind(self.inputs, leaves))
        return captured


def _evaluated(spec: structure.Spec, binding: sizes.Binding) -> structure.Spec:
    """The output structure with the sizes it returns (`x.shape[1]`, recorded by the
    export as symbols) evaluated at these inputs' sizes."""
    if spec.kind == "const":
        value = spec.context
        if isinstance(value, (torch.SymFloat, torch.SymBool)) or (
            isinstance(value, torch.SymInt) and sizes.value_of(value, binding) is None
        ):
            raise CaptureError(f"the model returns {value}, which has no value here")
        if isinstance(value, torch.SymInt):
            return dataclasses.replace(spec, context=sizes.value_of(value, binding))
        return spec
    if not spec.children:
        return spec
    children = tuple(_evaluated(c, binding) for c in spec.children)
    return dataclasses.replace(spec, children=children)


def export_family(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dims: Sequence[DimSpec],
) -> Family:
    """Export `model` at (args, kwargs), with the leaves' dims in `dims` symbolic."""
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    exported = export_model(lambda m, box: _Leaves(m, box, spec), model, leaves, {}, (tuple(dims),))
    placeholders = list(exported.program.graph_module.graph.find_nodes(op="placeholder"))
    user = _user_inputs(exported.program)
    inputs = [placeholders[i].meta.get("val") for i in user]
    note = _note(inputs, dims, exported.program.range_constraints)
    return Family(exported, list(dims), inputs, note, _frozen(exported.program))


def _frozen(ep: Any) -> dict[str, torch.Tensor]:
    """The model's tensors the export reads, by qualified name (what watch.py follows)."""
    from torch.export.graph_signature import InputKind

    # only what the graph reads: a change elsewhere (num_batches_tracked) matters not
    read = {n.name for n in ep.graph_module.graph.find_nodes(op="placeholder") if n.users}
    tensors = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    out: dict[str, torch.Tensor] = {}
    for s in ep.graph_signature.input_specs:
        if s.kind in tensors and s.arg.name in read:
            out[strip(s.target)] = lifted(ep, s.target)
    return out


def _user_inputs(ep: Any) -> list[int]:
    from torch.export.graph_signature import InputKind

    return [
        i for i, s in enumerate(ep.graph_signature.input_specs) if s.kind == InputKind.USER_INPUT
    ]


def _note(inputs: Sequence[Any], dims: Sequence[DimSpec], ranges: Any) -> str:
    symbolic: list[str] = []
    fixed: list[str] = []
    for k, (val, asked) in enumerate(zip(inputs, dims)):
        if not isinstance(val, torch.Tensor):
            continue
        for d, s in enumerate(val.shape):
            if sizes.is_symbolic(s):
                symbolic.append(f"input {k} dim {d} = {s}")
            elif asked and d in asked:
                fixed.append(f"input {k} dim {d} stays {s}")
    bounds = ", ".join(
        f"{s} in [{r.lower}, {'inf' if 'oo' in str(r.upper) else r.upper}]"
        for s, r in ranges.items()
        if r.lower is not None
    )
    note = (
        f"exported once with symbolic sizes ({'; '.join(symbolic)}; {bounds}): every input "
        "shape the export admits is captured from it, its kernels taking the sizes as "
        "arguments, without exporting again"
        if symbolic
        else "no size asked to be symbolic stayed so in the export"
    )
    if fixed:
        note += (
            f"; specialised by the export, because the model's code needs their value: "
            f"{'; '.join(fixed)}"
        )
    return note


def changed_dims(known: Sequence[Any], leaves: Sequence[Any]) -> list[DimSpec] | None:
    """Per leaf, the dims whose size differs from signature `known` (structure.signature) as
    `Dim.AUTO` (but dims now 0 or 1); None when the inputs differ in more than tensor sizes,
    or not at all."""
    if len(known) != len(leaves):
        return None
    out: list[DimSpec] = []
    for was, now in zip(known, leaves):
        if was[0] != "tensor" or not isinstance(now, torch.Tensor):
            if was[0] == "tensor" or isinstance(now, torch.Tensor):
                return None
            out.append(None)
            continue
        _, shape, _, dtype, device = was
        if (dtype, device, len(shape)) != (now.dtype, str(now.device), now.dim()):
            return None
        # a new size of 0 or 1 would come back from the export specialised to it (torch's
        # 0/1 specialisation): that export would serve only it, and keep refusing the sizes
        # after it, so such a shape compiles on its own
        auto = torch.export.Dim.AUTO
        dims = {d: auto for d, (a, b) in enumerate(zip(shape, now.shape)) if a != b and b > 1}
        out.append(dims or None)
    return out if any(out) else None


def given_dims(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic_shapes: Any,
) -> list[DimSpec]:
    """The caller's `dynamic_shapes` per leaf of (args, kwargs). As torch.export takes it:
    a dict by the names of the model's forward parameters (a `*args` parameter's entry a
    sequence, a `**kwargs` one's a dict), or a sequence, one entry per argument of the
    call (positional ones, then keywords); a tensor's dims as a dict or a sequence."""
    values = [*args, *kwargs.values()]
    if isinstance(dynamic_shapes, dict):
        specs = _by_name(model, args, kwargs, dynamic_shapes)
    elif isinstance(dynamic_shapes, (tuple, list)):
        if len(dynamic_shapes) > len(values):
            raise ValueError(
                f"opfuse: dynamic_shapes has {len(dynamic_shapes)} entries for "
                f"{len(values)} arguments"
            )
        specs = list(dynamic_shapes) + [None] * (len(values) - len(dynamic_shapes))
    else:
        raise TypeError("opfuse: dynamic_shapes must be a dict, tuple or list")
    out: list[DimSpec] = []
    for value, spec in zip(values, specs):
        _leaf_dims(value, spec, out)
    return out


def _by_name(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], given: dict[str, Any]
) -> list[Any]:
    """A dict of dynamic shapes by parameter name, per argument of the call."""
    params = inspect.signature(model.forward).parameters
    kinds = inspect.Parameter
    positional = [
        p.name
        for p in params.values()
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    var_args = next((p.name for p in params.values() if p.kind == kinds.VAR_POSITIONAL), None)
    var_kw = next((p.name for p in params.values() if p.kind == kinds.VAR_KEYWORD), None)
    unknown = set(given) - set(params)
    if unknown:
        raise ValueError(
            f"opfuse: dynamic_shapes names {sorted(unknown)}, which are not parameters of "
            f"the model's forward ({', '.join(params)})"
        )
    specs: list[Any] = []
    for i in range(len(args)):
        if i < len(positional):
            specs.append(given.get(positional[i]))
        else:
            rest = given.get(var_args) if var_args is not None else None
            j = i - len(positional)
            specs.append(rest[j] if rest is not None and j < len(rest) else None)
    for k in kwargs:
        if k in params and params[k].kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD):
            specs.append(given.get(k))
        else:
            rest = given.get(var_kw) if var_kw is not None else None
            specs.append(rest.get(k) if isinstance(rest, dict) else None)
    return specs


def _leaf_dims(value: Any, spec: Any, out: list[DimSpec]) -> None:
    if isinstance(value, torch.Tensor):
        if spec is None:
            out.append(None)
        elif isinstance(spec, dict):
            out.append(dict(spec) or None)
        elif isinstance(spec, (tuple, list)):
            out.append({d: s for d, s in enumerate(spec) if s is not None} or None)
        else:
            raise TypeError(f"opfuse: a tensor's dynamic_shapes entry is {spec!r}")
        return
    children, _ = pytree.tree_flatten(value)
    if not children:  # None, an empty container: no leaf
        return
    if len(children) == 1 and children[0] is value:  # a leaf that is no tensor
        out.append(None)
        return
    if spec is None:
        out.extend(None for _ in children)
        return
    if isinstance(value, dict) and isinstance(spec, dict):
        for key in value:
            _leaf_dims(value[key], spec.get(key), out)
        return
    if isinstance(value, (tuple, list)) and isinstance(spec, (tuple, list)):
        for v, s in zip(value, spec, strict=True):
            _leaf_dims(v, s, out)
        return
    raise TypeError(f"opfuse: dynamic_shapes entry {spec!r} does not match its argument")
