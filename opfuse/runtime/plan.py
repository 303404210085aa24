"""Fusion groups + built kernels -> the runtime Plan: steps in order, value slots, and the
memory pool for intermediates and scratch (see runtime.py for how it runs)."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..fusion.groups import Partition
from ..ir.attention import run_attention
from ..ir.graph import CONSTANT, GETITEM, INPUT, Graph, Node, TensorMeta, map_args
from ..ir.ops import ATTENTION, info
from ..ir.size import undecided
from ..lower.bounds import output_bounds
from ..lower.depthwise import DepthwiseKernel
from ..lower.dw_gemm import DwGemmKernel
from ..lower.epilogue import GemmKernel
from ..lower.kernel import Kernel
from .execute import (
    Const,
    In,
    KernelArg,
    KernelStep,
    Out,
    Packed,
    Plan,
    Scratch,
    Slot,
    TorchStep,
)
from .finite import FiniteGuard, gain, largest, transfer


@dataclass
class BuiltKernel:
    """A generated kernel. In an epilogue group it is the unfused epilogue: the anchor
    runs first as a library call."""

    kernel: Kernel
    fn: Any
    anchor_call: BuiltCall | None = None  # how the anchor runs; None: with torch
    # the graph's size symbols the kernel takes after its buffers, their values at this
    # size (a graph with symbolic sizes: backends/c/module._sized)
    sizes: tuple[int, ...] = ()


@dataclass
class BuiltGemm:
    """A blocked GEMM (or depthwise convolution) with its epilogue; `b` is the packed weight
    (or None: B is read from the graph), `gemm_fn` the library function's address."""

    kernel: GemmKernel | DepthwiseKernel | DwGemmKernel
    fn: Any
    b: Any
    gemm_fn: int
    # B is a static input the kernel reads packed: how to pack it (on the first call and
    # whenever it changes; execute.Packed)
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None
    sizes: tuple[int, ...] = ()  # size symbols' values, after the library function's address


@dataclass
class BuiltCall:
    """The whole group as one library call (oneDNN post-ops): call(*inputs) -> output."""

    call: Callable[..., Any]
    inputs: list[Node]
    output: Node
    library: str = "onednn"  # what the report calls it
    # The same call writing its result over inputs[donor] (when the plan finds that input
    # dead afterwards): inplace(*inputs) -> that input.
    inplace: Callable[..., Any] | None = None
    donor: int | None = None
    guard: FiniteGuard | None = None  # bounds through the call; NaN kept by its post-op
    # The same call set up where the size symbols take other values (by C name), sharing
    # its packed weights: a compile serving other sizes (runtime/sized.py); None: it
    # serves only these.
    at: Callable[[Mapping[str, int]], BuiltCall] | None = None


@dataclass(frozen=True)
class Absorbed:
    """The group runs inside another group's kernel (a depthwise convolution inside the
    matmul that reads it: lower/dw_gemm.py): no step of its own."""

    into: int


Built = BuiltKernel | BuiltGemm | BuiltCall | Absorbed


def _aliases_input(n: Node) -> bool:
    """Does this torch op return a view of one of its inputs?"""
    if n.op == GETITEM:
        return True
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return True  # unknown callable: assume it may alias
    return any(r.alias_info is not None for r in schema.returns)


def _pure_view(n: Node) -> bool:
    """Is n an aten op returning a view of an argument and writing nothing (view, expand,
    permute, slice...)? The runtime computes such a step once when its base is fixed."""
    schema = getattr(n.target, "_schema", None)
    return n.op != GETITEM and schema is not None and not schema.is_mutable and _aliases_input(n)


def _viewed(n: Node) -> Node:
    """The tensor a GEMM's A operand is a view of, where both start at the same element:
    the kernel reads that tensor's storage with the view's strides (the operand's leading
    dimension), so no torch view runs per call. A 1x1 convolution as a matmul reads its
    NHWC input through a permute and a view: 2-3 us of torch a call each."""
    while _pure_view(n) and n.args and isinstance(n.args[0], Node):
        base = n.args[0]
        if not (
            isinstance(base.meta, TensorMeta)
            and (base.tensor.offset, base.tensor.dtype, base.tensor.device)
            == (n.tensor.offset, n.tensor.dtype, n.tensor.device)
        ):
            break
        n = base
    return n


# Torch ops whose result may go into the pool through their out= overload: the GEMMs that
# run unfused or as library groups (an MLP's 8x512x3072 hidden layer is 48 MiB).
POOLED_OUT = frozenset(
    {"aten.addmm.default", "aten.mm.default", "aten.bmm.default", "aten.baddbmm.default"}
)


# Functional ops AOTAutograd emits that copy their first argument before writing into it
# (an embedding's backward: zeros, then index_put of the gradient rows: a 94 MiB copy for
# BERT's vocabulary). When that argument is a dead torch result nothing else holds, the
# in-place variant writes into it instead.
_aten = torch.ops.aten
IN_PLACE = {
    "aten.index_put.default": _aten.index_put_.default,
    "aten.index_add.default": _aten.index_add_.default,
    "aten.scatter_add.default": _aten.scatter_add_.default,
    "aten.scatter.src": _aten.scatter_.src,
    "aten.scatter.value": _aten.scatter_.value,
    "aten.scatter_reduce.two": _aten.scatter_reduce_.two,
}


# opfuse's own ops whose body a torch step calls directly: the dispatcher's way to a Python
# custom op costs more than a short attention computes (ir/attention.run_attention).
DIRECT: dict[str, Callable[..., Any]] = {ATTENTION: run_attention}


class _Planner:
    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.slot = {n: i for i, n in enumerate(graph.nodes)}
        self.by_name = {n.name: n for n in graph.nodes}
        self.steps: list[KernelStep | TorchStep] = []
        self.ready: set[Node] = {n for n in graph.nodes if n.op in (INPUT, CONSTANT)}
        self.torch_made: set[Node] = set()
        self.readers: dict[Node, list[int]] = {}

    def read(self, n: Node) -> None:
        self.readers.setdefault(n, []).append(len(self.steps) - 1)

    def torch_step(self, n: Node, fn: Callable[..., Any] | None = None) -> None:
        for i in n.inputs():
            self.need(i)
        target = fn or (operator.getitem if n.op == GETITEM else DIRECT.get(n.op, n.target))
        s = self.slot
        inplace = IN_PLACE.get(n.op) if fn is None and isinstance(n.meta, TensorMeta) else None
        self.steps.append(
            TorchStep(
                n.name,
                target,
                map_args(n.args, lambda a: Slot(s[a])),
                {k: map_args(v, lambda a: Slot(s[a])) for k, v in n.kwargs},
                s[n],
                out_fn=n.target.overloadpacket.out if fn is None and n.op in POOLED_OUT else None,
                view=fn is None and _pure_view(n),
                inplace=inplace,
                donate=0 if inplace is not None else None,
                donor=n.tensor if inplace is not None else None,
            )
        )
        for i in n.inputs():
            self.read(i)
        self.ready.add(n)
        self.torch_made.add(n)

    def call_step(self, b: BuiltCall) -> None:
        # Built objects name nodes; the plan may be of a subgraph (autotuning) with copies.
        inputs = [self.by_name[i.name] for i in b.inputs]
        output = self.by_name[b.output.name]
        for i in inputs:
            self.need(i)
        self.steps.append(
            TorchStep(
                output.name,
                b.call,
                tuple(Slot(self.slot[i]) for i in inputs),
                {},
                self.slot[output],
                inplace=b.inplace,
                donate=b.donor if b.inplace is not None else None,
                donor=output.tensor if b.inplace is not None else None,
                guard=b.guard,
                at=b.at,
            )
        )
        for i in inputs:
            self.read(i)
        self.ready.add(output)
        self.torch_made.add(output)

    def need(self, n: Node) -> None:
        """Make sure value n exists before the next step (views run lazily, with torch)."""
        if n not in self.ready:
            self.torch_step(n)

    def kernel_step(self, name: str, fn: Any, args: list[KernelArg], reads: list[Node]) -> None:
        self.steps.append(KernelStep(name, fn, args, tensors=getattr(fn, "tensors", False)))
        for i in reads:
            self.read(i)

    def kernel_args(
        self, k: Kernel, scratch: tuple[str, int] | None = None
    ) -> tuple[list[KernelArg], list[Node]]:
        """Arguments for k's buffers; `scratch` names the buffer the runtime provides as
        scratch memory, and its size in bytes."""
        args: list[KernelArg] = []
        reads: list[Node] = []
        for b in k.buffers:
            node = self.by_name[b.value]
            if scratch is not None and b.role == "in" and b.name == scratch[0]:
                args.append(Scratch(scratch[1]))
            elif b.role == "in":
                self.need(node)
                args.append(In(self.slot[node], node.tensor, node in self.torch_made))
                reads.append(node)
            else:
                args.append(Out(self.slot[node], node.tensor))
        return args, reads

    def produced(self, args: list[KernelArg]) -> None:
        for a in args:
            if isinstance(a, Out):
                self.ready.add(self.g.nodes[a.slot])


def copied(graph: Graph, plan: Plan) -> list[Node]:
    """The data-movement ops (cat, pad, flip, repeat) the plan runs with torch: those a
    library call, a torch op or the caller reads whole (a kernel reads through them)."""
    ran = {s.name for s in plan.steps if isinstance(s, TorchStep)}
    return [n for n in graph.nodes if info(n.op).copies and n.name in ran]


def build_plan(graph: Graph, part: Partition, built: Mapping[int, Built]) -> Plan:
    """`built` maps group id -> how it runs; groups without an entry run with torch."""
    p = _Planner(graph)
    # each kernel step, with its kernel and (a GEMM's) the built GEMM and its A's slot
    kernels: list[tuple[KernelStep, Kernel, BuiltGemm | None, int]] = []
    for g in part.groups:
        b = built.get(g.id)
        if isinstance(b, Absorbed):
            continue
        if b is None:
            for n in g.nodes:
                p.torch_step(n)
        elif isinstance(b, BuiltCall):
            p.call_step(b)
        elif isinstance(b, BuiltGemm):
            k = b.kernel
            a_node = _viewed(p.by_name[k.input.name])
            p.need(a_node)
            args: list[KernelArg] = [In(p.slot[a_node], a_node.tensor, a_node in p.torch_made)]
            reads = [a_node]
            if b.b is not None:
                args.append(Const(b.b))
            else:
                assert isinstance(k, GemmKernel)  # a depthwise kernel's filters are packed
                bn = p.by_name[k.spec.b.node.name]
                p.need(bn)
                if b.pack is not None:
                    args.append(Packed(p.slot[bn], b.pack))
                else:
                    args.append(In(p.slot[bn], bn.tensor, bn in p.torch_made))
                reads.append(bn)
            scratch = (k.gemm_buffer, k.scratch_bytes)
            epi_args, epi_reads = p.kernel_args(k.epilogue, scratch=scratch)
            args += epi_args
            args.append(Const(b.gemm_fn))
            args += [Const(v) for v in b.sizes]
            p.kernel_step(k.name, b.fn, args, reads + epi_reads)
            p.produced(args)
            step = p.steps[-1]
            if isinstance(k, GemmKernel) and isinstance(step, KernelStep):
                kernels.append((step, k.epilogue, b, p.slot[a_node]))
                # the epilogue's buffers are the arguments after A and B
                pos = {buf.name: i + 2 for i, buf in enumerate(k.epilogue.buffers)}
                step.inplace = [(pos[o], pos[i]) for o, i in k.epilogue.inplace]
            elif isinstance(k, DepthwiseKernel) and isinstance(step, KernelStep):
                kernels.append((step, k.epilogue, b, p.slot[a_node]))
        else:
            if b.anchor_call is not None:
                p.call_step(b.anchor_call)
            elif g.anchor is not None and g.pattern.epilogue:
                p.torch_step(g.anchor)  # unfused: the library call, then the epilogue kernel
            args, reads = p.kernel_args(b.kernel)
            args += [Const(v) for v in b.sizes]
            p.kernel_step(b.kernel.name, b.fn, args, reads)
            pos = {buf.name: i for i, buf in enumerate(b.kernel.buffers)}
            step = p.steps[-1]
            assert isinstance(step, KernelStep)
            step.inplace = [(pos[o], pos[i]) for o, i in b.kernel.inplace]
            p.produced(args)
            kernels.append((step, b.kernel, None, -1))
    for out in graph.outputs:
        if isinstance(out, Node):
            p.need(out)
    if any(isinstance(s, TorchStep) and s.guard is not None for s in p.steps):
        _carry_bounds(graph, p, kernels)
    sizes, frees = _plan_memory(graph, p)
    return Plan(
        n_slots=len(graph.nodes),
        input_slots=[p.slot[i] for i in graph.inputs],
        outputs=[Slot(p.slot[o]) if isinstance(o, Node) else o for o in graph.outputs],
        # Only constants a step reads: weights the chosen implementations prepacked are not
        # kept twice.
        constants={
            p.slot[n]: graph.constants[n.name]
            for n in graph.nodes
            if n.op == CONSTANT and (n in p.readers or n in graph.output_set)
        },
        steps=p.steps,
        pool_sizes=sizes,
        frees=frees,
        device=_pool_device(p.steps),
    )


def _carry_bounds(
    graph: Graph, p: _Planner, kernels: list[tuple[KernelStep, Kernel, BuiltGemm | None, int]]
) -> None:
    """Give each kernel step whose outputs can be bounded from its inputs' the function
    that does it at run time (lower/bounds.py), so that the guarded library calls after
    it need not measure what it made (runtime/finite.py). A GEMM's result is bounded by
    its frozen weight's gain times its input's bound."""
    by_name = p.by_name
    constants: dict[str, str | None] = {}
    # by step: the source of each output slot's bound, and the slots it reads
    carried: dict[int, tuple[dict[int, str], list[int]]] = {}

    def constant(name: str) -> str | None:
        if name not in constants:
            m = largest(graph.constants[name])
            constants[name] = repr(m) if math.isfinite(m) else None
        return constants[name]

    for step, kernel, gemm, a_slot in kernels:
        # the bound of each input buffer, as source over the slots' bounds `b`
        leaves: dict[str, str | None] = {}
        for buf in kernel.inputs:
            node = by_name[buf.value]
            if gemm is not None and buf.name == gemm.kernel.gemm_buffer:
                if isinstance(gemm.kernel, DepthwiseKernel):
                    leaves[buf.name] = _conv_bound(graph, gemm.kernel, a_slot)
                else:
                    g = _gemm_gain(gemm)
                    leaves[buf.name] = None if g is None else f"({g!r} * b[{a_slot}])"
            elif node.op == CONSTANT:
                leaves[buf.name] = constant(node.name)
            else:
                leaves[buf.name] = f"b[{p.slot[node]}]"
        found = output_bounds(kernel, leaves.get)
        if not found:
            continue
        values = {buf.name: buf.value for buf in kernel.outputs}
        outs = {p.slot[by_name[values[name]]]: text for name, text in found.items()}
        reads = [int(i) for text in found.values() for i in _SLOT_REF.findall(text)]
        carried[id(step)] = (outs, reads)
    kept = _read_by_guards(p.steps, carried)
    for step, _, _, _ in kernels:
        if id(step) in kept:
            step.bound = transfer(*carried[id(step)])


def _read_by_guards(
    steps: list[Any], carried: dict[int, tuple[dict[int, str], list[int]]]
) -> set[int]:
    """The kernel steps (by id) whose bounds reach a guarded call, through a chain of
    bounded steps and views; only those get a bound function. A kernel step that carries
    bounds runs from Python rather than inside a run of kernels called from C
    (runtime/runs.py): ConvNeXt-T's depthwise kernels, whose bounds no guard reads,
    would otherwise all leave its runs."""
    kept: set[int] = set()
    needed: set[int] = set()
    for step in reversed(steps):
        if isinstance(step, TorchStep):
            if step.guard is not None:
                needed.update(a.index for a in step.args[: 2 if step.guard.binary else 1])
            elif step.view and isinstance(step.args[0], Slot) and step.output in needed:
                needed.add(step.args[0].index)
            continue
        io = carried.get(id(step))
        if io is not None and needed.intersection(io[0]):
            needed.update(io[1])
            kept.add(id(step))
    return kept


_SLOT_REF = re.compile(r"b\[(\d+)\]")


def _conv_bound(graph: Graph, k: DepthwiseKernel, x_slot: int) -> str | None:
    """A bound of opfuse's own convolution's result (bias included: the depthwise, direct
    and Winograd kernels add it), as source over its input's bound: the frozen filters'
    gain times it, plus the bias's largest |value|. Winograd's transforms only add,
    subtract and halve (LIMIT's margin covers them), and its tiles that come out inf or
    NaN are summed again directly."""
    w: Any = graph.constants.get(k.weight.name) if k.weight.op == CONSTANT else None
    if w is None:
        return None
    g = getattr(w, "_opfuse_gain", None)
    if g is None:
        g = w._opfuse_gain = gain(w)  # (shared by the compiles at other sizes)
    offset = 0.0
    if k.bias is not None:
        if k.bias.op != CONSTANT or k.bias.name not in graph.constants:
            return None
        offset = largest(graph.constants[k.bias.name])
    if not (math.isfinite(g) and math.isfinite(offset)):
        return None
    return f"({g!r} * b[{x_slot}] + {offset!r})"


def _gemm_gain(b: BuiltGemm) -> float | None:
    """The largest sum of |B| over one column of a GEMM's frozen weight (what the packed
    copy was made from), None where there is no such weight or it is not finite."""
    k = b.kernel
    if not isinstance(k, GemmKernel) or k.spec.kind == "bmm" or k.spec.batch != 1:
        return None
    source = getattr(b.b, "_opfuse_source", None)
    if not isinstance(source, torch.Tensor) or tuple(source.shape) != (k.spec.k, k.spec.n):
        return None
    # kept with the packed copy, which the compiles of a graph at other sizes share
    g = getattr(b.b, "_opfuse_gain", None)
    if g is None:
        g = b.b._opfuse_gain = gain(source.t())  # B's columns are the outputs
    return g if math.isfinite(g) else None


def _pool_device(steps: list[Any]) -> str:
    """The one device every kernel output lives on (pooled blocks are allocated there)."""
    devices = {
        a.meta.device
        for s in steps
        if isinstance(s, KernelStep)
        for a in s.args
        if isinstance(a, Out)
    }
    if len(devices) > 1:
        raise NotImplementedError(f"kernels on several devices: {sorted(devices)}")
    return devices.pop() if devices else "cpu"


def _plan_memory(graph: Graph, p: _Planner) -> tuple[list[int], list[tuple[int, ...]]]:
    """Assign pool blocks to kernel intermediates, scratch and the results of the GEMMs torch
    runs (written through out=), greedily in step order. An
    intermediate lives until the last read of it or of any alias of it; one that escapes
    (is, or has a view that is, a graph output) gets fresh memory per call. An output may
    take its input's block when the kernel allows it (in place) and this is that input's
    last read, or the input itself when torch made it and nothing else can still see it.
    Also returns, per step, the slots that are dead after it."""
    alias_of: dict[Node, Node] = {}
    for s in p.steps:
        if isinstance(s, TorchStep):
            n = graph.nodes[s.output]
            if _aliases_input(n) and n.inputs():
                base = n.inputs()[0]
                alias_of[n] = alias_of.get(base, base)
    escapes = {alias_of.get(o, o) for o in graph.output_set}
    last_read: dict[Node, int] = {}
    for n, rs in p.readers.items():
        base = alias_of.get(n, n)
        last_read[base] = max(last_read.get(base, -1), *rs)
    aliases: dict[Node, list[Node]] = {}
    for n, base in alias_of.items():
        aliases.setdefault(base, []).append(n)
    frees: list[list[int]] = [[] for _ in p.steps]
    for n in p.ready:
        base = alias_of.get(n, n)
        if base not in escapes and base in last_read:
            # a view lets go at its own last read (its base's memory stays while the base
            # is read): a library call may then write over a base no view still holds
            own = _own_last_read(p, n) if n is not base else None
            frees[own if own is not None else last_read[base]].append(p.slot[n])
    sizes: list[int] = []
    free_at: list[int] = []  # step after which each block is free
    block_of: dict[Node, int] = {}

    # Which free block a buffer takes weighs their sizes (waste) alone: any choice is
    # correct at every size, whose blocks are then as large as their largest buffer there
    # (a graph with symbolic sizes served at others: runtime/sized.pool_sizes).
    def best_fit(start: int, end: int, size: int) -> int:
        best = None
        with undecided():
            for b in range(len(sizes)):
                if free_at[b] < start and (
                    best is None or _fit(sizes[b], size) < _fit(sizes[best], size)
                ):
                    best = b
            if best is None:
                sizes.append(size)
                free_at.append(end)
                return len(sizes) - 1
            sizes[best] = max(sizes[best], size)
        free_at[best] = end
        return best

    for si, step in enumerate(p.steps):
        if (
            isinstance(step, TorchStep)
            and step.donate is not None
            and not _donatable(p, step, si, alias_of, aliases, escapes, last_read)
        ):
            step.donate = None
        if isinstance(step, TorchStep) and step.out_fn is not None:
            node = graph.nodes[step.output]
            m = node.meta
            if (
                node not in escapes
                and node in last_read
                and isinstance(m, TensorMeta)
                and m.is_contiguous()
                and m.offset == 0
            ):
                step.out_block = best_fit(si, last_read[node], storage_bytes(m))
                step.out_meta = m
                block_of[node] = step.out_block
                p.torch_made.discard(node)  # pool memory: never stolen or donated
        if not isinstance(step, KernelStep):
            continue
        partner = dict(step.inplace)
        for ai, a in enumerate(step.args):
            if isinstance(a, Scratch):
                a.block = best_fit(si, si, a.nbytes)
                continue
            if not isinstance(a, Out):
                continue
            node = graph.nodes[a.slot]
            src = step.args[partner[ai]] if ai in partner else None
            if isinstance(src, In) and _stealable(
                p, step, si, src, a, alias_of, escapes, last_read
            ):
                base = alias_of.get(graph.nodes[src.slot], graph.nodes[src.slot])
                a.steal = partner[ai]
                a.clear = tuple(
                    p.slot[x]
                    for x in [base, *aliases.get(base, [])]
                    if x in p.slot and p.slot[x] != src.slot
                )
                continue
            if node in escapes or not isinstance(node.meta, TensorMeta):
                continue
            end = last_read.get(node, si)
            size = storage_bytes(a.meta)
            if isinstance(src, In):
                src_node = graph.nodes[src.slot]
                src_base = alias_of.get(src_node, src_node)
                blk = block_of.get(src_base)
                if (
                    blk is not None
                    and src_node.tensor.offset == src_base.tensor.offset  # a view from 0
                    and last_read.get(src_base) == si
                    and free_at[blk] == si
                ):
                    with undecided():
                        sizes[blk] = max(sizes[blk], size)
                    free_at[blk] = end
                    a.block = blk
                    block_of[node] = blk
                    continue
            a.block = best_fit(si, end, size)
            block_of[node] = a.block
    return sizes, [tuple(f) for f in frees]


def _stealable(
    p: _Planner,
    step: KernelStep,
    si: int,
    src: In,
    out: Out,
    alias_of: dict[Node, Node],
    escapes: set[Node],
    last_read: dict[Node, int],
) -> bool:
    """May `out` be written over `src`'s tensor? Only a fresh torch result (not an input, a
    constant or a view of one), dead after this step, read by no other argument here, with
    the same elements at the same addresses. The runtime still checks that nothing else
    holds it."""
    g = p.g
    node = g.nodes[src.slot]
    base = alias_of.get(node, node)
    if (
        base not in p.torch_made
        or base.op in (INPUT, CONSTANT)
        or base in escapes
        or last_read.get(base) != si
        or not _same_order(src.meta, out.meta)
    ):
        return False
    others = [a for a in step.args if isinstance(a, In) and a is not src]
    return all(alias_of.get(g.nodes[a.slot], g.nodes[a.slot]) is not base for a in others)


def _donatable(
    p: _Planner,
    step: TorchStep,
    si: int,
    alias_of: dict[Node, Node],
    aliases: dict[Node, list[Node]],
    escapes: set[Node],
    last_read: dict[Node, int],
) -> bool:
    """May a library call write its result over its argument `step.donate`? Only over a
    torch result no view of which is read from this step on, dead after this step, read by
    no other argument here, laid out exactly as the result. The runtime still checks that
    nothing else holds it."""
    assert step.donate is not None
    slot = step.args[step.donate]
    assert isinstance(slot, Slot)
    node = p.g.nodes[slot.index]
    out = p.g.nodes[step.output]
    return (
        node in p.torch_made
        and node not in alias_of
        and all(_read_before(p, v, si) for v in aliases.get(node, ()))
        and node not in escapes
        and last_read.get(node) == si
        and sum(a == slot for a in step.args) == 1
        and isinstance(node.meta, TensorMeta)
        and isinstance(out.meta, TensorMeta)
        and (node.meta.shape, node.meta.stride, node.meta.dtype)
        == (out.meta.shape, out.meta.stride, out.meta.dtype)
    )


def _own_last_read(p: _Planner, n: Node) -> int | None:
    """The last step that reads n itself (not another view of its base); None: none does."""
    reads = p.readers.get(n)
    return max(reads) if reads else None


def _read_before(p: _Planner, n: Node, si: int) -> bool:
    """Is n read, and by steps before `si` only? (A view read by none is held until its
    base's last read.)"""
    last = _own_last_read(p, n)
    return last is not None and last < si


def _same_order(a: TensorMeta, b: TensorMeta) -> bool:
    """Do a and b lay the same elements out at the same addresses?"""
    if a.dtype != b.dtype or a.numel != b.numel:
        return False
    return (a.shape, a.stride) == (b.shape, b.stride) or (a.is_contiguous() and b.is_contiguous())


def _fit(block: int, size: int) -> int:
    """Smaller is better: waste if the block is big enough, else the growth needed."""
    return block - size if block >= size else (size - block) * 4


def storage_bytes(m: TensorMeta) -> int:
    """Bytes spanned by a strided tensor (its largest offset + 1 element)."""
    return m.span * m.dtype.itemsize
