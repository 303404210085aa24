"""The compiler on one screen.

graph   = capture(model)                frontend/        torch.export / AOTAutograd
graph   = pass(graph, ctx), for each    rewrite/passes   fold BatchNorm, constants; attention;
          of REWRITES                                    layout; 1x1 convs as matmuls;
                                                         pools as window reductions
kinds   = classify(graph)               fusion/classify  ordered op kinds
groups  = partition(graph, kinds)       fusion/          the decision, with why-nots
kernels = lower(groups)                 lower/           loop nest + scalar expressions
source  = render(kernels)               backends/c       C with OpenMP (strings only)
library = build(source)                 backends/c       compile, cache, load
built   = tune(groups, library)         autotune.py      measure where there is a choice
plan    = plan(groups, built)           runtime/plan     steps, slots, memory pool
run(plan, inputs)                       runtime/execute
report  = make_report(...)              report/          what fused, what did not, and why

Each step records its time (and the rewrites their notes) in a Context (context.py) that
the report reads; OPFUSE_DEBUG_DIR writes the graph after every rewrite.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .autotune import tune
from .backends.base import Module
from .backends.c.module import build_modules
from .backends.triton.build import build_module as build_triton
from .context import Context
from .fusion.classify import classify
from .fusion.groups import Partition, check_partition
from .fusion.partition import Fuel, partition
from .ir import scalar
from .ir.graph import Graph, size_symbols
from .ir.size import Decisions, adopt, deciding
from .lower.epilogue import GemmKernel
from .lower.groups import Lowered, lower_groups
from .lower.lowering import why_not_lowered
from .options import Options
from .report.make import make_report
from .report.tables import FoldReport, FusionReport, RejectReport
from .rewrite import cleanup
from .rewrite.passes import REWRITES
from .runtime.execute import Plan, Runtime
from .runtime.heap import collector_paused, release_freed_memory
from .runtime.plan import BuiltGemm, build_plan, copied
from .runtime.sized import plan_at

log = logging.getLogger("opfuse")


@dataclass
class CompiledGraph:
    """A graph ready to run: call it with the graph inputs, get the graph outputs."""

    graph: Graph
    run: Runtime
    report: FusionReport
    source: str
    # A graph with symbolic sizes: the decisions its compile took from their values, and
    # the symbols' values it was compiled at (runtime/sized.py serves other values with it)
    decisions: Decisions | None = None
    values: dict[str, int] = field(default_factory=dict)
    generic: bool = False  # its kernels take every Size as an argument (Module.generic)
    kernels: str = ""  # the source of the kernels it runs (of the C backend)
    template: Plan | None = None  # the plan with its Sizes (`run` runs it evaluated)

    def __call__(self, inputs: list[Any]) -> list[Any]:
        return self.run(inputs)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def compile_graph(
    graph: Graph, options: Options | None = None, eager_kernels: int | None = None
) -> CompiledGraph:
    """Everything after capture: rewrite, fuse, lower, render, build, tune, plan."""
    return compile_graphs([graph], options, [eager_kernels])[0]


@dataclass
class _Front:
    """A graph rewritten, partitioned and lowered: what the build needs."""

    graph: Graph
    ctx: Context
    part: Partition
    lowered: Lowered
    backend: str
    why: str
    seconds: float  # spent so far


def compile_graphs(
    graphs: Sequence[Graph],
    options: Options | None = None,
    eager_kernels: Sequence[int | None] | None = None,
) -> list[CompiledGraph]:
    """Compile several graphs at once: each is fused and planned on its own, their C
    kernels are built as one library (the static regions of a graph with symbolic sizes:
    one compiler run, the kernels their layers repeat built once)."""
    opts = options or Options()
    symbols = size_symbols(graphs)
    with collector_paused(), scalar.sized(symbols), deciding() as decisions:
        for g in graphs:  # what the capture took from the sizes as plain numbers
            for fixed in g.fixed:
                decisions.test(fixed)
        out = _compile_graphs(graphs, opts, eager_kernels)
    if symbols:
        values = dict(symbols)
        for c in out:
            c.decisions, c.values, c.template = decisions, values, c.run.plan
            c.run = Runtime(plan_at(c.template, values))
    return out


def _compile_graphs(
    graphs: Sequence[Graph], opts: Options, eager_kernels: Sequence[int | None] | None
) -> list[CompiledGraph]:
    fronts = [_front(g, opts) for g in graphs]
    c = [f for f in fronts if f.backend != "triton"]
    t0 = time.perf_counter()
    built = dict(zip(map(id, c), build_modules([(f.graph, f.lowered) for f in c])))
    shared = (time.perf_counter() - t0) / max(len(c), 1)  # each graph's share of the build
    out = []
    for f, kernels in zip(fronts, eager_kernels or [None] * len(fronts)):
        t1 = time.perf_counter()
        if f.backend == "triton":
            with f.ctx.timed("render and build"):
                module = build_triton(f.graph, f.lowered)
        else:
            module = built[id(f)]
            f.ctx.seconds["render and build"] = shared
            f.seconds += shared
        out.append(_back(f, module, kernels, t1))
    return out


def _front(graph: Graph, opts: Options) -> _Front:
    t0 = time.perf_counter()
    chosen, why = backend(graph, opts)
    ctx = Context(opts, ("cpu", "cuda") if chosen == "triton" else ("cpu",))
    graph = rewrite(graph, ctx)
    with ctx.timed("partition"):
        kinds = classify(graph, ctx.devices)
        part = partition(graph, kinds, why_not_lowered, Fuel(opts.fuel))
        check_partition(graph, part)
    with ctx.timed("lower"):
        lowered = lower_groups(graph, part, checked=chosen == "triton")
    return _Front(graph, ctx, part, lowered, chosen, why, time.perf_counter() - t0)


def _back(f: _Front, module: Module, eager_kernels: int | None, t0: float) -> CompiledGraph:
    """Tune and plan a built graph; report what was done."""
    graph, ctx, part, opts = f.graph, f.ctx, f.part, f.ctx.options
    if module.problem:
        warn_once(module.problem.splitlines()[0])
    with ctx.timed("tune"):
        built, decisions = tune(graph, part, module, opts.implementation)
    for b in built.values():  # the decisions of the tiles chosen (the losers' take none)
        if isinstance(b, BuiltGemm) and isinstance(b.kernel, GemmKernel):
            adopt(b.kernel.decided)
    with ctx.timed("plan"):
        plan = build_plan(graph, part, built)
    report = make_report(
        graph, part, f.lowered, built, decisions, eager_kernels, module.source, copied(graph, plan)
    )
    _from_context(report, ctx)
    report.backend = f"{f.backend} ({f.why})"
    report.compile_seconds = f.seconds + time.perf_counter() - t0
    report.cached = module.cached
    if module.problem:
        report.warnings.append(module.problem)
    triton = f.backend == "triton"
    if opts.debug_dir:
        dump(ctx, module.source, report, triton)
    compiled = CompiledGraph(graph, Runtime(plan), report, module.source)
    compiled.generic, compiled.kernels = module.running(built.values())
    release_freed_memory()
    return compiled


def rewrite(graph: Graph, ctx: Context) -> Graph:
    given = cleanup.storages(graph)
    for p in REWRITES:
        graph = ctx.run(p, graph)
    return cleanup.fresh_outputs(graph, given)


def _from_context(report: FusionReport, ctx: Context) -> None:
    report.folds = [FoldReport(f.conv, f.batchnorm) for f in ctx.folds]
    kept = [RejectReport(r.producer, r.batchnorm, r.reason) for r in ctx.refusals]
    report.rejected = kept + report.rejected
    report.layout = ctx.layout
    report.attention = ctx.notes.get("fuse_attention", [])
    report.random = ctx.notes.get("random_in_kernels", [])
    report.constants = ctx.notes.get("fold_constants", [])
    report.pools = ctx.notes.get("pools_in_kernels", [])
    report.conv_rows = ctx.notes.get("convs_as_rows", [])
    report.passes = {k: round(v, 6) for k, v in ctx.seconds.items()}


def backend(graph: Graph, opts: Options) -> tuple[str, str]:
    """The backend that runs the graph's kernels, and why: Options.backend, "auto" resolved
    by where the graph's tensors live."""
    if opts.backend != "auto":
        return opts.backend, "Options.backend / OPFUSE_BACKEND"
    gpu = sorted(graph.devices - {"cpu"})
    if any(d.startswith("cuda") for d in gpu):
        return "triton", f"tensors on {', '.join(gpu)}"
    return "c", "tensors on the CPU"


def dump(ctx: Context, source: str, report: FusionReport, triton: bool) -> None:
    """The generated source and the report, next to the per-pass graphs."""
    ctx.dump("source.py" if triton else "source.c", source)
    ctx.dump("report.txt", str(report) + "\n")
    ctx.dump("report.json", report.to_json(indent=1))
