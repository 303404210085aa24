"""The compiler on one screen.

graph  = capture(model)                 capture.py       torch.export / AOTAutograd
graph  = rewrite(graph)                 rewrite/         fold BatchNorm, fold constants
kinds  = classify(graph)                fusion/classify  ordered op kinds
groups = partition(graph, kinds)        fusion/          the decision, with why-nots
kernels = lower(groups)                 lower/           loop nest + scalar expressions
source = render(kernels)                backends/c       C with OpenMP (strings only)
library = build(source)                 backends/c       compile, cache, load
plan   = plan(groups, library)          plan.py          steps, slots, memory pool
run(plan, inputs)                       runtime.py
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fusion.classify import classify
from .fusion.groups import Partition, check_partition
from .fusion.partition import Fuel, partition
from .ir.graph import Graph
from .lower.kernel import Kernel
from .lower.lowering import NotFusable, lower_group
from .plan import BuiltKernel, build_plan
from .report import FoldReport, FusionReport, RejectReport
from .rewrite.batchnorm import Fold, Refusal, fold_batchnorm, lower_batchnorm
from .rewrite.cleanup import fold_constants
from .runtime import Runtime

log = logging.getLogger("opfuse")


@dataclass
class Options:
    """Compiler switches. Defaults come from the environment (OPFUSE_*)."""

    fuel: int | None = field(default_factory=lambda: _env_int("OPFUSE_FUEL"))
    debug_dir: str | None = field(default_factory=lambda: os.environ.get("OPFUSE_DEBUG_DIR"))
    fold_batchnorm: bool = True
    freeze: bool = True  # parameters are constants (eval-mode opfuse.compile)


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


@dataclass
class CompiledGraph:
    """A graph ready to run: call it with the graph inputs, get the graph outputs."""

    graph: Graph
    run: Runtime
    report: FusionReport
    source: str

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
    """Everything after capture: rewrite, fuse, lower, render, build, plan."""
    opts = options or Options()
    t0 = time.perf_counter()
    graph, folds, refusals = rewrite(graph, opts)
    kinds = classify(graph)
    part = partition(graph, kinds, Fuel(opts.fuel))
    check_partition(graph, part)
    kernels = lower(graph, part)
    source, built, cached, problem = build_kernels(kernels)
    plan = build_plan(graph, part, built)
    from .explain import make_report

    report = make_report(graph, part, kernels, built, eager_kernels, source)
    report.folds = [FoldReport(f.conv, f.batchnorm) for f in folds]
    report.rejected = [RejectReport(r.producer, r.batchnorm, r.reason) for r in refusals] + (
        report.rejected
    )
    report.compile_seconds = time.perf_counter() - t0
    report.cached = cached
    if problem:
        report.warnings.append(problem)
    if opts.debug_dir:
        dump(opts.debug_dir, source, report)
    return CompiledGraph(graph, Runtime(plan), report, source)


def rewrite(graph: Graph, opts: Options) -> tuple[Graph, list[Fold], list[Refusal]]:
    folds: list[Fold] = []
    refusals: list[Refusal] = []
    if opts.fold_batchnorm:
        graph, folds, refusals = fold_batchnorm(graph)
    graph = fold_constants(graph)
    graph = lower_batchnorm(graph)
    return fold_constants(graph), folds, refusals


def lower(graph: Graph, part: Partition) -> dict[int, Kernel]:
    kernels: dict[int, Kernel] = {}
    for g in part.groups:
        if g.pattern in ("elementwise", "reduction"):
            try:
                kernels[g.id] = lower_group(graph, g.nodes)
            except NotFusable as e:  # the partitioner checked this; keep going regardless
                g.pattern, g.reason = "fallback", f"could not be lowered: {e}"
    return kernels


def build_kernels(kernels: dict[int, Kernel]) -> tuple[str, dict[int, BuiltKernel], bool, str]:
    """Render all kernels into one translation unit and compile it. If that fails, warn
    once and return no kernels: their groups then run with torch."""
    if not kernels:
        return "", {}, True, ""
    from .backends.c.build import BuildError, build
    from .backends.c.render import render_module

    names = {gid: f"{k.name}_{gid}" for gid, k in kernels.items()}
    source = render_module([(names[gid], k) for gid, k in kernels.items()])
    try:
        lib = build(source)
    except BuildError as e:
        msg = f"opfuse: kernels could not be built, running those ops with torch ({e})"
        warn_once(msg.splitlines()[0])
        return source, {}, False, msg
    built = {gid: BuiltKernel(k, lib.fn(names[gid])) for gid, k in kernels.items()}
    return source, built, lib.cached, ""


def dump(directory: str, source: str, report: FusionReport) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{id(report) % 10000:04d}"
    (d / f"graph-{stamp}.c").write_text(source)
    (d / f"graph-{stamp}.txt").write_text(str(report) + "\n")
    (d / f"graph-{stamp}.json").write_text(report.to_json(indent=1))
