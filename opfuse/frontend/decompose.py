"""What capture decomposes, and how: the decomposition table (torch's core ATen table, with
the ops opfuse keeps whole or decomposes its own way), and the op-by-op retrace of an
exported graph.

The retrace: retracing the whole graph with make_fx costs a dispatch through fake tensors
for every op, also for the many ops no decomposition touches (BERT-base: 0.7-1.2 s of a
3.3 s compile).
Here only the ops a decomposition applies to are traced, and an op seen before with the
same argument layouts reuses its trace, so a model's repeated blocks trace once; all of
them in one make_fx call, cut apart afterwards and spliced into a copy of the graph
(BERT-base: 17 distinct ops of 466, 0.15 s; ResNet-50: 55, 0.2 s).

A graph with symbolic sizes (an export with `Dim`s) is retraced the same way, under the
export's own fake mode, so its symbols stay the export's: each distinct op in a make_fx call
of its own (a symbolic trace reads a size from whichever input first carried its symbol,
which must be that op's own), taking size arguments as inputs too. BERT-base with the
length symbolic: 0.34 s against `run_decompositions`' 3.9. A decomposition that would add a
guard on the symbols (an assumption about the sizes the export did not make) is refused;
the export's shape environment has learnt the guard by then, so the caller decomposes a
fresh export with `run_decompositions`."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from . import sizes

aten = torch.ops.aten

# Upsampling runs torch's kernel (nearest by powers of two: an index map kernels read
# through); every mode's decomposition gathers with index tensors.
_UPSAMPLE = (
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
)

_KEEP_WHOLE = (
    aten.roll.default,  # an index map kernels read through (decomposed: two index_selects)
    *(getattr(aten, name).default for name in _UPSAMPLE),  # see keep_whole
    # Their decompositions gather with index tensors, run op by op with torch: reflect and
    # replicate padding 20-30x slower than torch's kernels, unfold/fold 3-4x.
    *(
        getattr(aten, f"{mode}_pad{d}d{suffix}").default
        for mode in ("reflection", "replication")
        for d in (1, 2, 3)
        for suffix in ("", "_backward")
    ),
    aten.im2col.default,
    aten.col2im.default,
    # Pointwise backward ops stay whole: the op table has their formulas, so keeping them
    # makes smaller graphs than their decompositions.
    aten.threshold_backward.default,
    aten.sigmoid_backward.default,
    aten.tanh_backward.default,
    aten.gelu_backward.default,
    aten.silu_backward.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.leaky_relu_backward.default,
    aten.hardtanh_backward.default,
    aten.elu_backward.default,
    aten.softplus_backward.default,
    aten.silu.default,
    aten.hardswish.default,
    aten.hardsigmoid.default,
    # Their decompositions round where torch's kernels do not (lerp's vector kernel is one
    # fused multiply-add, addcdiv divides value * tensor1): the op table has eager's forms.
    aten.lerp.Scalar,
    aten.lerp.Tensor,
    aten.addcdiv.default,
)

# A GRU / Elman RNN unrolls into a dozen ops per time step, layer and direction (measured:
# a 2-layer bidirectional GRU over 50 steps, 816 ops, 3.2x slower than eager's one call,
# 20 s to compile); whole, it runs torch's own loop. (LSTM's decomposition calls oneDNN's
# fused layer, so it stays.)
RECURRENT = (
    aten.gru.input,
    aten.gru.data,
    aten.rnn_tanh.input,
    aten.rnn_tanh.data,
    aten.rnn_relu.input,
    aten.rnn_relu.data,
)

_DECOMPOSE = (
    aten.native_layer_norm,
    aten._softmax,
    aten._log_softmax,
    aten.native_group_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten.native_batch_norm,
    aten.linalg_vector_norm,
    aten.std,
    aten.std_mean,
    aten.logsumexp,
    aten.native_dropout,
)


def decompositions(listed: bool = True) -> dict[Any, Callable[..., Any]]:
    """The decomposition table of both capture paths (export's retrace, AOTAutograd's joint
    forward/backward trace), made once. `listed=False` leaves out the
    CompositeImplicitAutograd ops that export's table lists one by one, each mapped to its
    own composite kernel: a make_fx trace runs those kernels anyway, and `retrace` asks an
    op whether it has one (collecting them took 0.25-0.4 s of a cold ResNet-50 compile)."""
    return _table(bool(listed))  # one cache entry per value, however the caller passes it


@functools.lru_cache(maxsize=2)
def _table(listed: bool) -> dict[Any, Callable[..., Any]]:
    import torch._decomp as decomp

    unlisted = getattr(decomp, "_core_aten_decompositions_post_autograd", None)
    table = dict(decomp.core_aten_decompositions() if listed or unlisted is None else unlisted())
    table.update(decomp.get_decompositions(list(_DECOMPOSE)))
    for op in _KEEP_WHOLE:
        table.pop(op, None)
    # BatchNorm without running statistics stays whole so that the BatchNorm pass can say
    # why it is not folded; it lowers it itself (rewrite/batchnorm.py).
    table.pop(aten._native_batch_norm_legit.no_stats, None)
    for op in RECURRENT:
        table.pop(op, None)
    # The user's scaled_dot_product_attention runs torch's flash kernel. Decomposed, it ran
    # 0.73-0.91x eager for sequences of 32-512 (8 x 12 heads x 64), inference. In training
    # the decomposition is also wrong: it returns the attention probabilities where the op
    # returns its log-sum-exp, and the flash backward AOTAutograd pairs with the op reads
    # that slot as log-sum-exp (q/k/v gradients off by up to 150). Inductor excludes it too.
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    table[aten._pad_circular.default] = _pad_circular
    table[aten.native_group_norm.default] = _group_norm
    for op in (aten.lstm.input, aten.lstm.data):
        if op in table:
            table[op] = functools.partial(_lstm, table[op])
    return table


def _group_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    c: int,
    hw: int,
    groups: int,
    eps: float,
) -> Any:
    """GroupNorm with its statistics taken per channel, then combined per group.

    torch's decomposition reduces a [N, G, C/G * H*W] view: on a channels-last image (the
    layout frozen conv graphs run in) each group's elements lie C apart and the reduction
    gathers them one by one (GroupNorm + SiLU 0.26x eager). Per-channel statistics are a
    reduction over the spatial dimensions in either layout (rows in NCHW, columns in NHWC);
    the group's mean is the mean of its channels' means and its variance the mean of
    var_c + (mean_c - mean)^2 (every channel counts H*W elements). The output is
    x * w + b with per-channel w = rstd * weight and b = bias - mean * w, as torch's CPU
    kernel computes it."""
    if input.dim() < 3 or c % groups or input.numel() == 0:
        return NotImplemented
    from torch._prims_common import get_computation_dtype

    x = input.to(get_computation_dtype(input.dtype))
    cg = c // groups
    var_c, mean_c = torch.var_mean(x, dim=list(range(2, x.dim())), correction=0)
    if cg == 1:  # a group per channel (InstanceNorm's statistics)
        mean, var = mean_c, var_c
    else:
        means = mean_c.view(n, groups, cg)
        mean = means.mean(-1)
        var = (var_c.view(n, groups, cg) + (means - mean[..., None]).square()).mean(-1)
    rstd = torch.rsqrt(var + eps)
    w = rstd[..., None].expand(n, groups, cg).reshape(n, c)
    if weight is not None:
        w = w * weight
    b = -mean[..., None].expand(n, groups, cg).reshape(n, c) * w
    if bias is not None:
        b = b + bias
    spatial = (1,) * (x.dim() - 2)
    out = x * w.view(n, c, *spatial) + b.view(n, c, *spatial)
    return out.to(input.dtype), mean.to(input.dtype), rstd.to(input.dtype)


# Whether the caller had oneDNN on when capture began (torch.export turns it off inside).
CALLER_ONEDNN = contextvars.ContextVar("opfuse_onednn", default=True)


def _lstm(decompose: Callable[..., Any], *args: Any) -> Any:
    """LSTM layers as oneDNN's fused layer, as eager runs them. torch.export switches
    oneDNN off while it decomposes, and the decomposition then unrolls every time step
    into a matmul and gates (an LSTM and a GRU: 8 kernels -> 70)."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(CALLER_ONEDNN.get() and torch.backends.mkldnn.is_available())
    try:
        return decompose(*args)
    finally:
        torch._C._set_mkldnn_enabled(was)


def _pad_circular(x: torch.Tensor, pad: Sequence[int]) -> Any:
    """Circular padding as one concatenation of wrapped slices per padded dimension.

    torch's composite writes slices into an empty tensor: in a functional graph six
    slice_scatters for a 2-d pad, each a copy of the whole output (0.08x eager). A cat is
    a gather kernels read through, or torch's one copy. Crops (negative pads) keep torch's
    composite."""
    k = len(pad) // 2
    if len(pad) % 2 or k > x.dim() or any(p < 0 for p in pad):
        return NotImplemented
    y = x
    for i in range(k):
        d = x.dim() - 1 - i
        left, right, n = pad[2 * i], pad[2 * i + 1], x.shape[d]
        if left > n or right > n:
            return NotImplemented  # wraps more than once: torch raises its own error
        parts = [y.narrow(d, n - left, left)] if left else []
        parts.append(y)
        if right:
            parts.append(y.narrow(d, 0, right))
        if len(parts) > 1:
            y = torch.cat(parts, d)
    return x.clone() if y is x else y  # the op returns a new tensor, never its input


@contextlib.contextmanager
def keep_whole() -> Iterator[None]:
    """Keep the upsampling ops whole while a trace decomposes: torch registers Python
    kernels that decompose them (into gathers with index tensors: bilinear ran 7-50x
    slower than torch's kernel, nearest 2x) at the Autograd and CompositeImplicit keys,
    before any decomposition table is consulted. They are set aside for the trace and put
    back; the C++ composite of .vec then calls .default, which the trace records."""
    keys = (torch._C.DispatchKey.Autograd, torch._C.DispatchKey.CompositeImplicitAutograd)
    saved = [(op, k, op.py_kernels.pop(k)) for op in _PY_WHOLE for k in keys if k in op.py_kernels]
    for op in _PY_WHOLE:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, k, fn in saved:
            op.py_kernels[k] = fn
        for op in _PY_WHOLE:
            op._dispatch_cache.clear()


_PY_WHOLE = tuple(
    getattr(getattr(aten, name), overload)
    for name in _UPSAMPLE
    for overload in ("vec", "default")
    if hasattr(getattr(aten, name), overload)
)


# The node metadata capture reads (shapes come from the traced nodes' own "val").
_KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


@dataclass
class _Op:
    """One distinct op (target and argument layouts) to decompose, and its trace."""

    target: Any
    flat: list[Any]  # its arguments, flattened; fx nodes where tensors go
    spec: Any
    at: list[int]  # positions of the tensors in flat
    inputs: list[torch.fx.Node] = field(default_factory=list)  # its placeholders
    nodes: list[torch.fx.Node] = field(default_factory=list)  # its decomposition
    out: Any = None  # its result: nodes of `nodes` or `inputs`


def retrace(
    gm: torch.fx.GraphModule,
    table: Mapping[Any, Callable[..., Any]],
    context: Callable[[], Any],
) -> torch.fx.GraphModule | None:
    """`gm` with every op that `table` or a composite kernel decomposes replaced by its
    decomposition, traced with make_fx under `context()`. None when a decomposition needs
    what a splice cannot carry (a constant attribute, a submodule)."""
    ops: dict[Any, _Op] = {}
    calls: dict[torch.fx.Node, tuple[_Op, list[Any]]] = {}  # node -> its op, its arguments
    mode = symbolic_mode(gm)
    args_ok = (torch.Tensor, torch.SymInt) if mode is not None else torch.Tensor
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if not _decomposes(n.target, table):
            continue
        flat, spec = pytree.tree_flatten((n.args, n.kwargs))
        at = [i for i, a in enumerate(flat) if isinstance(a, torch.fx.Node)]
        if not all(isinstance(flat[i].meta.get("val"), args_ok) for i in at):
            return None
        key = (n.target, tuple(_key(a) for a in flat))
        calls[n] = (ops.setdefault(key, _Op(n.target, flat, spec, at)), flat)
    if mode is None:
        if ops and not _trace(list(ops.values()), table, context):
            return None
    elif not _trace_symbolic(list(ops.values()), table, context, mode):
        return None

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            src = env[n.args[0]]
            if isinstance(src, (tuple, list)):  # an element of a decomposed op's result
                env[n] = src[n.args[1]]
                continue
        if n not in calls:
            env[n] = graph.node_copy(n, lambda x: env[x])
            continue
        op, flat = calls[n]
        env[n] = _splice(graph, op, [env[flat[i]] for i in op.at], n.meta)
    return torch.fx.GraphModule(gm, graph)


def symbolic_mode(gm: torch.fx.GraphModule) -> Any:
    """The fake mode of a graph whose inputs have symbolic sizes, else None."""
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if not any(map(sizes.has_symbolic_sizes, tensors)):
        return None
    mode = detect_fake_mode(tensors)
    return mode if mode is not None and mode.shape_env is not None else None


def _trace_symbolic(
    ops: list[_Op], table: Mapping[Any, Any], context: Callable[[], Any], mode: Any
) -> bool:
    """Trace each op's decomposition on its own arguments' symbolic values (_trace with
    one op per make_fx call, in the export's fake mode). False when one adds a runtime
    assertion or a guard on the symbols (other than a fake kernel's choice of layout), or
    leaves what a splice cannot carry."""
    from torch.fx.experimental.proxy_tensor import make_fx

    before = shape_env_state(mode)
    for op in ops:
        vals = [op.flat[i].meta["val"] for i in op.at]
        with mode:
            marker = torch.zeros(())
        with context():
            traced = make_fx(_runner([op]), decomposition_table=table, tracing_mode="symbolic")(
                *vals, marker
            )
        if not _cut(traced, [op]):
            return False
    after = shape_env_state(mode)
    if after[1:] != before[1:]:  # a size made a constant, or a runtime assertion
        return False
    return all(_layout_only(g) for g in mode.shape_env.guards[before[0] :])


def shape_env_state(mode: Any) -> tuple[int, int, int]:
    """How much a fake mode's shape environment has learnt: (guards, sizes it replaced by
    an expression or a constant, runtime assertions). It only grows."""
    env = mode.shape_env
    asserts = sum(map(len, env.deferred_runtime_asserts.values()))
    return len(env.guards), len(env.replacements), asserts


def _layout_only(guard: Any) -> bool:
    """Is a guard one a fake kernel took to choose its result's strides (the convolution's
    memory format by the input's size)? Capture computes every value's layout again at
    each call's sizes (convert.propagate), so such a guard binds nothing."""
    frame = getattr(getattr(guard, "sloc", None), "framework_loc", None)
    path = (getattr(frame, "filename", "") or "").replace("\\", "/")
    return path.endswith("torch/_subclasses/fake_impls.py") and getattr(frame, "name", "") == "conv"


def _runner(ops: list[_Op]) -> Callable[..., Any]:
    """The function make_fx traces: every op on its tensors, each followed by a cut (1
    added to the marker, the last input)."""

    def run(*tensors: torch.Tensor) -> Any:
        marker, k, outs = tensors[-1], 0, []
        for op in ops:
            vals = list(op.flat)
            for i in op.at:
                vals[i], k = tensors[k], k + 1
            args, kwargs = pytree.tree_unflatten(vals, op.spec)
            outs.append((op.target(*args, **kwargs), marker + 1))
        return outs

    return run


def _cut(traced: torch.fx.GraphModule, ops: list[_Op]) -> bool:
    """Assign the traced graph's nodes to the ops they decompose (the adds of the marker
    are the cuts). False when a decomposition left what a splice cannot carry."""
    placeholders = list(traced.graph.find_nodes(op="placeholder"))
    marker = placeholders[-1]
    k = 0
    for op in ops:
        op.inputs, k = placeholders[k : k + len(op.at)], k + len(op.at)
    i = 0
    for x in traced.graph.nodes:
        if x.op in ("get_attr", "call_module"):
            return False
        if x.op == "call_function" and marker in x.args:
            i += 1  # the cut after op i
        elif x.op == "call_function":
            # (a symbolic trace may read a size for the outputs after the last cut)
            ops[min(i, len(ops) - 1)].nodes.append(x)
        elif x.op == "output":
            for op, (out, _) in zip(ops, x.args[0], strict=True):
                op.out = out
    return True


def _trace(ops: list[_Op], table: Mapping[Any, Any], context: Callable[[], Any]) -> bool:
    """Trace every op's decomposition in one make_fx call (a trace's setup costs more than
    most decompositions: ResNet-50 has 55 distinct ones) and cut the graph into each op's
    part: after each op the function adds 1 to a marker input, and those adds are the cuts.
    False when a decomposition left what a splice cannot carry."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = [_empty_like(op.flat[i].meta["val"]) for op in ops for i in op.at]
        fakes.append(torch.zeros(()))

    with context():
        traced = make_fx(_runner(ops), decomposition_table=table, tracing_mode="fake")(*fakes)
    return _cut(traced, ops)


def _decomposes(target: Any, table: Mapping[Any, Any]) -> bool:
    """Would make_fx (with `table`) trace `target` into other ops? Ops with Python kernels
    are retraced too: the Python dispatcher may route them elsewhere (eval BatchNorm)."""
    if not isinstance(target, torch._ops.OpOverload):
        return True  # a Python callable: traced to find out
    return (
        target in table
        or bool(target.py_kernels)
        or torch._C._dispatch_has_kernel_for_dispatch_key(
            target.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        )
    )


def _key(a: Any) -> tuple[Any, ...]:
    """An argument as the trace depends on it: a tensor's layout, any other value itself."""
    if isinstance(a, torch.fx.Node):
        t = a.meta["val"]
        if isinstance(t, torch.SymInt):
            return ("SymInt", str(t))
        # (str: a symbolic size is no key; its expression is, within one export)
        return (*map(str, (*t.shape, "/", *t.stride(), t.storage_offset())), t.dtype, str(t.device))
    return (type(a).__name__, repr(a))


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor (fake, under a FakeTensorMode) with t's exact layout, sizes plain."""
    shape = tuple(int(s) for s in t.shape)
    stride = tuple(int(s) for s in t.stride())
    offset = int(t.storage_offset())
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    span = 0 if 0 in shape else 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride))
    base = torch.empty(offset + span, dtype=t.dtype, device=t.device)
    return base.as_strided(shape, stride, offset)


def _splice(graph: torch.fx.Graph, op: _Op, inputs: list[Any], meta: dict[str, Any]) -> Any:
    """Copy op's decomposition into `graph`, its placeholders bound to `inputs`; returns
    the values of its result (a node, or a tuple of them). The copies carry the decomposed
    op's module path and source line."""
    bound: dict[torch.fx.Node, Any] = dict(zip(op.inputs, inputs, strict=True))
    for x in op.nodes:
        y = graph.node_copy(x, lambda z: bound[z])
        for k in _KEPT_META:
            if k in meta:
                y.meta[k] = meta[k]
        bound[x] = y
    return pytree.tree_map(lambda y: bound[y] if isinstance(y, torch.fx.Node) else y, op.out)
