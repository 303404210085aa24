"""An ATen-level fx graph -> opfuse Graph: every shape re-derived from example inputs (or
the export's symbolic sizes, as Sizes), views and strides kept as torch lays them out, each
op's source traced back to the user's module and line. capture.py's exports and dynamo's
AOTAutograd graphs (`capture_fx`) both come through here."""

from __future__ import annotations

import operator
import os
import re
import weakref
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..ir.graph import GETITEM, INPUT, STATIC, Graph, GraphBuilder, Node, Source, TensorMeta
from ..ir.size import Size
from . import sizes, structure

aten = torch.ops.aten


class CaptureError(RuntimeError):
    """The model could not be traced to a static ATen graph."""


# Ops that assert or annotate and produce nothing we need.
ASSERTIONS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
}


def capture_fx(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    static: Collection[int] = (),
    frozen: Collection[int] = (),
) -> tuple[Graph, list[int]]:
    """Convert an ATen-level fx graph, re-deriving every shape from `example_inputs`
    (concrete tensors, or fake ones with static shapes). Returns the graph and, per graph
    input, its position among the fx graph's arguments (sizes passed as ints are baked in).
    The arguments at the positions in `static` are the same tensors on every call (a
    module's parameters and buffers, as dynamo passes them): their input nodes say so.
    Those at the positions in `frozen` become constants (the tensors given, which must be
    real), as an eval-mode opfuse.compile freezes them: folded, prepacked, laid out."""
    vals = propagate(gm, example_inputs)
    symbolic = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    binding = sizes.bind(symbolic, example_inputs)
    placeholders: dict[str, Any] = {}
    positions: list[int] = []
    fixed: set[str] = set()
    k = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = vals[n]
            given = example_inputs[k]
            if k in frozen and isinstance(given, torch.Tensor):
                placeholders[n.name] = ("constant", (n.name, given.detach()))
            elif isinstance(v, torch.Tensor):
                placeholders[n.name] = ("input", ("user", k))
                positions.append(k)
                if k in static:
                    fixed.add(n.name)
            else:
                placeholders[n.name] = ("value", sizes.sized(v, n.meta.get("val"), binding))
            k += 1
    graph, _ = convert(gm, placeholders, [], vals, fixed, binding)
    return graph, positions


def propagate(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> dict[torch.fx.Node, Any]:
    """Run the graph on fake tensors of the inputs' exact shapes and strides, so symbolic
    sizes in the graph become plain ints."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # One mode per export, and one fake per layout in it: the parameters' fakes are made
    # once, not at every shape the export serves (ResNet-50: 0.29 s a shape)
    found = _fake_modes.get(gm)
    if found is None:
        found = _fake_modes[gm] = (FakeTensorMode(allow_non_fake_inputs=True), {})
    mode, made = found
    vals: dict[torch.fx.Node, Any] = {}

    class Prop(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            vals[n] = out
            return out

    def fake(t: torch.Tensor) -> torch.Tensor:
        key = (tuple(map(int, t.shape)), tuple(map(int, t.stride())), t.dtype, t.device)
        if key not in made:
            made[key] = _static_empty(t)
        return made[key]

    with mode:
        fakes = [fake(t) if isinstance(t, torch.Tensor) else _concrete(t) for t in inputs]
        Prop(gm).run(*fakes)
    return vals


_fake_modes: weakref.WeakKeyDictionary[torch.fx.GraphModule, tuple[Any, dict[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _static_empty(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor (fake, under a FakeTensorMode) of `t`'s shape, strides, dtype and
    device, symbolic sizes made plain ints."""
    return torch.empty_strided(
        tuple(int(s) for s in t.shape),
        tuple(int(s) for s in t.stride()),
        dtype=t.dtype,
        device=t.device,
    )


def _concrete(v: Any) -> Any:
    if isinstance(v, torch.SymInt):
        return int(v)
    if isinstance(v, torch.SymFloat):
        return float(v)
    if isinstance(v, torch.SymBool):
        return bool(v)
    return v


# -- fx -> Graph --------------------------------------------------------------------------
def _meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        if free_unbacked_symbols(v):
            # torch.unique, nonzero, masked_select...: kernels are compiled for one shape
            raise CaptureError(
                f"a tensor's shape {tuple(v.shape)} depends on the data (unique, nonzero, "
                "boolean indexing...)"
            )
        return TensorMeta.of(v)
    if isinstance(v, (tuple, list)):
        return tuple(_meta(x) for x in v)
    return None


def convert(
    gm: torch.fx.GraphModule,
    placeholders: dict[str, Any],
    input_roles: list[tuple[str, Any]],
    vals: dict[torch.fx.Node, Any] | None = None,
    static: Collection[str] = (),
    binding: sizes.Binding | None = None,
    strides: Sequence[tuple[int, ...] | None] = (),
) -> tuple[Graph, dict[torch.fx.Node, Any]]:
    """`binding`: the values of the graph's size symbols at this call (frontend/sizes.py),
    which make its symbolic sizes Sizes. `strides`: per output, eager's (or None), which
    an output whose strides differ is copied to."""
    b = GraphBuilder()
    bound = binding or {}

    def meta_of(n: torch.fx.Node, v: Any) -> Any:
        m = _meta(v)
        val = n.meta.get("val")
        if bound and isinstance(m, TensorMeta):
            return sizes.sized_meta(m, val, bound)
        if bound and isinstance(m, tuple) and isinstance(val, (tuple, list)):
            return tuple(
                sizes.sized_meta(x, y, bound) if isinstance(x, TensorMeta) else x
                for x, y in zip(m, val)
            )
        return m

    env: dict[torch.fx.Node, Any] = {}

    def value_of(n: torch.fx.Node) -> Any:
        return vals[n] if vals is not None else n.meta.get("val")

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        sizes.fix(a, value := _concrete(a))
        return value

    with sizes.fixing(b.fixed):  # (the values taken from symbolic sizes: Graph.fixed)
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                kind, payload = placeholders[n.name]
                if kind == "input":
                    kw = {STATIC: True} if n.name in static else None
                    env[n] = b.add(INPUT, (), kw, meta=meta_of(n, value_of(n)), name=n.name)
                    input_roles.append(payload)
                elif kind == "constant":
                    env[n] = b.constant(payload[1], _safe_name(payload[0]))
                else:
                    env[n] = payload
                    if not isinstance(payload, Size):  # (a size input given as a number)
                        sizes.fix(n.meta.get("val"), payload)
            elif n.op == "get_attr":
                t = _fetch_attr(gm, n.target)
                env[n] = b.constant(
                    t.detach() if isinstance(t, torch.Tensor) else t, _safe_name(n.target)
                )
            elif n.op == "call_function":
                v = value_of(n)
                if not isinstance(v, (torch.Tensor, tuple, list)) and not _is_tensor_op(n):
                    # Size arithmetic: a plain value (a Size where dynamo has it symbolic).
                    env[n] = sizes.sized(_concrete(v), n.meta.get("val"), bound)
                    continue
                op = _op_name(n.target)
                if op in ASSERTIONS:
                    continue
                env[n] = b.add(
                    op,
                    arg(n.args),
                    {k: arg(v2) for k, v2 in n.kwargs.items()},
                    meta=meta_of(n, v),
                    name=n.name,
                    source=_source(n),
                    target=n.target,
                )
            elif n.op == "output":
                outs = n.args[0]
                outs = outs if isinstance(outs, (tuple, list)) else (outs,)
                results = [env.get(o) if isinstance(o, torch.fx.Node) else o for o in outs]
                if len(strides) == len(results):
                    results = [_restride(b, r, s) for r, s in zip(results, strides)]
                graph = b.build(results)
                return graph, env
            else:
                raise CaptureError(f"unsupported fx node {n.op} {n.target}")
    raise CaptureError("graph has no output")


def _restride(b: GraphBuilder, x: Any, strides: tuple[int, ...] | None) -> Any:
    """Output x, copied to `strides` (dense) where its own differ in a dim of more than one
    element: permuted to their order, made contiguous, permuted back."""
    m = x.meta if isinstance(x, Node) else None
    if strides is None or not isinstance(m, TensorMeta) or len(strides) != len(m.shape):
        return x
    if all(n == 1 or int(a) == s for n, a, s in zip(m.shape, m.stride, strides)):
        return x
    order = sorted(range(len(strides)), key=lambda d: -strides[d])
    if order == list(range(len(order))):  # eager's layout is the contiguous one
        return b.call(aten.clone.default, x, memory_format=torch.contiguous_format)
    y = b.call(aten.permute.default, x, order)
    y = b.call(aten.clone.default, y, memory_format=torch.contiguous_format)
    return b.call(aten.permute.default, y, sorted(range(len(order)), key=order.__getitem__))


def _is_tensor_op(n: torch.fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and any(
        r.type.kind() == torch._C.TensorType.get().kind() for r in n.target._schema.returns
    )


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return GETITEM
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _safe_name(name: str) -> str:
    return re.sub(r"\W", "_", name)


_TORCH_DIR = os.path.dirname(torch.__file__)
# opfuse's own wrapper frames around the user's forward (not the user's code)
_OWN_FRAMES = {
    os.path.abspath(__file__),
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "capture.py"),
    os.path.abspath(structure.__file__),
}
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)')


def _source(n: torch.fx.Node) -> Source:
    """The innermost nn.Module and the last user-code frame an op came from."""
    module = module_type = ""
    stack = n.meta.get("nn_module_stack")
    if stack:
        qualname, typ = list(stack.values())[-1]
        module = _clean_module_path(qualname)
        module_type = (typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))).split(
            "."
        )[-1]
    location = code = ""
    frames = _FRAME.findall(n.meta.get("stack_trace") or "")
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR) and f[0] not in _OWN_FRAMES]
    if user or frames:
        path, line, code = (user or frames)[-1]
        location = f"{os.path.basename(path)}:{line}"
    return Source(module, module_type, location, code.strip())


def _clean_module_path(q: str) -> str:
    """'L['self'].layers[0].fc' / 'L__self___layers_0_fc' / 'm.layers.0' -> 'layers.0.fc'."""
    q = re.sub(r"^L\['self'\]\.?", "", q)
    q = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", q)
    q = q.replace("_modules.", "")
    q = q.lstrip(".")
    if q.startswith("m.") or q == "m":
        q = q[2:]
    return q
