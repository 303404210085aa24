"""Graphs with symbolic sizes: compiled once, whatever sizes later calls bring.

Dynamo hands the backend a graph with symbolic sizes (`s0`) after a recompile for a new
size (automatic dynamic) or under `torch.compile(dynamic=True)`. opfuse's kernels are
generated for static sizes, so such a graph is split in two kinds of regions:

    static   every value it computes and reads has sizes that do not depend on a symbol:
             cut out as a sub-graph that opfuse compiles once, fused as any graph is
    dynamic  the rest (the growing KV cache's cat, attention over it, views sized by s0,
             size arithmetic): stays in the outer fx graph and runs with torch each call

A text generator's decode step is static but for attention over the cache: its linears,
LayerNorms and GELUs are static regions, so one compile serves every length. Dynamo's
guards keep the static sizes static for every call the graph serves.

Regions are cut by torch.fx's capability partitioner, which keeps them free of cycles
(a static region never waits for a dynamic value that itself needs the region).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

# Ops that only re-view or pick: a region of nothing else is not worth a compile.
_NO_WORK = {
    "view",
    "_unsafe_view",
    "reshape",
    "permute",
    "transpose",
    "t",
    "expand",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "alias",
    "detach",
    "split",
    "split_with_sizes",
    "unbind",
    "as_strided",
}


def symbolic(value: Any) -> bool:
    """Does the value (a tensor's sizes and strides, or a number) hold a symbol?"""
    if isinstance(value, torch.Tensor):
        return any(not isinstance(s, int) for s in (*value.shape, *value.stride()))
    if isinstance(value, (tuple, list)):
        return any(symbolic(v) for v in value)
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def has_symbols(example_inputs: Sequence[Any]) -> bool:
    """Do a graph's example inputs hold symbolic sizes (or symbolic numbers)?"""
    return any(symbolic(x) for x in example_inputs)


def _static_node(n: torch.fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is torch.ops.aten.sym_size.int or not _known(n):
        return False
    return all(_known(a) for a in n.all_input_nodes)


def _known(n: torch.fx.Node) -> bool:
    """The node's value is tensors (or nothing) of static sizes."""
    val = n.meta.get("val")
    if val is None:
        return False
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return all(isinstance(v, torch.Tensor) for v in vals) and not symbolic(val)


class _Static(OperatorSupportBase):
    def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
        return _static_node(node)


def _works(nodes: Sequence[torch.fx.Node]) -> bool:
    for n in nodes:
        packet = getattr(n.target, "_overloadpacket", None)
        name = getattr(packet, "__name__", "")
        if name and name not in _NO_WORK:
            return True
    return False


@dataclass
class Split:
    """The graph cut into regions: `module` runs the dynamic ones with torch and calls
    each static region by its name; `regions` holds, per name, the region's graph and the
    example values of its inputs (static sizes)."""

    module: torch.fx.GraphModule
    regions: dict[str, tuple[torch.fx.GraphModule, list[Any]]] = field(default_factory=dict)
    dynamic_ops: list[str] = field(default_factory=list)  # ops left to torch, by name
    symbols: list[str] = field(default_factory=list)  # the graph's size symbols
    # per region, the positions of its inputs that are the graph's static inputs
    static: dict[str, frozenset[int]] = field(default_factory=dict)


PREFIX = "static_"


def static_share(gm: torch.fx.GraphModule) -> float:
    """The fraction of the graph's ops that do work (not views) whose sizes are static."""
    work = [n for n in gm.graph.nodes if n.op == "call_function" and _works([n])]
    return sum(_static_node(n) for n in work) / len(work) if work else 0.0


def split_static(gm: torch.fx.GraphModule, static: Collection[int] = ()) -> Split:
    """Cut a copy of `gm` (a graph with symbolic sizes) into static regions and the
    rest; `gm` itself is left as it was. `static`: the positions of gm's inputs that are
    the same tensors on every call (parameters), which regions learn of theirs."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    gm = torch.fx.GraphModule(gm, graph)
    partitioner = CapabilityBasedPartitioner(gm, _Static(), allows_single_node_partition=True)
    parts = [p for p in partitioner.propose_partitions() if _works(list(p.nodes))]
    region_nodes = {n for p in parts for n in p.nodes}
    dynamic_ops = [
        n.name for n in gm.graph.nodes if n.op == "call_function" and n not in region_nodes
    ]
    if not parts:
        return Split(gm, {}, dynamic_ops, symbols(gm))
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    fixed = {placeholders[i] for i in static}
    fused = partitioner.fuse_partitions(parts, prefix=PREFIX)
    regions: dict[str, tuple[torch.fx.GraphModule, list[Any]]] = {}
    region_static: dict[str, frozenset[int]] = {}
    for n in fused.graph.nodes:
        if n.op == "call_module" and n.target.startswith(PREFIX):
            sub = getattr(fused, n.target)
            examples = [a.meta.get("val") for a in n.args]
            regions[n.target] = (sub, examples)
            region_static[n.target] = frozenset(
                i
                for i, a in enumerate(n.args)
                if isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name in fixed
            )
    return Split(fused, regions, dynamic_ops, symbols(gm), region_static)


def symbols(gm: torch.fx.GraphModule) -> list[str]:
    """The size symbols of the graph's inputs, by name."""
    found = {
        str(s)
        for n in gm.graph.nodes
        if n.op == "placeholder"
        for s in _free_symbols(n.meta.get("val"))
    }
    return sorted(found)


def _free_symbols(val: Any) -> set[Any]:
    if isinstance(val, torch.Tensor):
        sizes: list[Any] = [*val.shape, *val.stride()]
    elif isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        sizes = [val]
    else:
        return set()
    out: set[Any] = set()
    for s in sizes:
        if not isinstance(s, int) and hasattr(s, "node"):
            out |= set(getattr(s.node.expr, "free_symbols", ()))
    return out


def install(split: Split, runners: Mapping[str, Callable[[list[Any]], Any]]) -> None:
    """Replace each static region of `split.module` with its runner, by name: a callable
    of the region's inputs returning its outputs as a sequence."""
    for name, (sub, _) in split.regions.items():
        out = next(n for n in sub.graph.nodes if n.op == "output")
        single = not isinstance(out.args[0], (tuple, list))
        setattr(split.module, name, _Region(runners[name], single))
    split.module.recompile()


class _Region(torch.nn.Module):
    def __init__(self, run: Callable[[list[Any]], Any], single: bool) -> None:
        super().__init__()
        self.run = run
        self.single = single  # the outer graph reads the one output, not a tuple of it

    def forward(self, *args: Any) -> Any:
        outs = self.run(list(args))
        return outs[0] if self.single else outs
