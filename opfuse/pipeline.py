"""The compiler on one screen.

graph  = capture(model)                 capture.py       torch.export / AOTAutograd
graph  = rewrite(graph)                 rewrite/         fold BatchNorm, constants; attention;
                                                         layout; pools as window reductions
kinds  = classify(graph)                fusion/classify  ordered op kinds
groups = partition(graph, kinds)        fusion/          the decision, with why-nots
kernels = lower(groups)                 lower/           loop nest + scalar expressions
source = render(kernels)                backends/c       C with OpenMP (strings only)
library = build(source)                 backends/c       compile, cache, load
plan   = plan(groups, library)          plan.py          steps, slots, memory pool
run(plan, inputs)                       runtime.py
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .autotune import Decision, Noise, choose, decision_key, load_decision
from .backends.c.module import Make, Module, Unavailable, build_module
from .backends.triton.build import build_module as build_triton
from .explain import make_report
from .fusion.classify import classify
from .fusion.groups import Partition, check_partition
from .fusion.partition import Fuel, partition
from .heap import release_freed_memory
from .ir.graph import CONSTANT, INPUT, Graph
from .lower.groups import IMPLEMENTATIONS, lower_groups
from .lower.lowering import why_not_lowered
from .plan import Built, BuiltCall, build_plan, copied
from .progress import Progress
from .report import FoldReport, FusionReport, RejectReport
from .rewrite.attention import fuse_attention
from .rewrite.batchnorm import Fold, Refusal, fold_batchnorm, lower_batchnorm
from .rewrite.cleanup import copies_in_kernels, fold_constants, split_to_views
from .rewrite.layout import channels_last
from .rewrite.pooling import pools_in_kernels
from .rewrite.random import random_in_kernels
from .runtime import Runtime
from .settings import check

log = logging.getLogger("opfuse")


@dataclass
class Options:
    """Compiler switches. Defaults come from the environment (OPFUSE_*)."""

    fuel: int | None = field(default_factory=lambda: _env_int("OPFUSE_FUEL"))
    debug_dir: str | None = field(default_factory=lambda: os.environ.get("OPFUSE_DEBUG_DIR"))
    fold_batchnorm: bool = True
    fuse_attention: bool = True  # matmul-softmax-matmul as one fused attention call
    freeze: bool = True  # parameters are constants (eval-mode opfuse.compile)
    # "channels-last": frozen conv graphs run NHWC between convolutions; "keep": as captured.
    layout: str = field(default_factory=lambda: os.environ.get("OPFUSE_LAYOUT") or "channels-last")
    # Force how epilogue and library groups run (one of lower.groups.IMPLEMENTATIONS:
    # "unfused", "blocked", "onednn", ...) where that is possible, instead of measuring:
    # for tests and for bisecting.
    implementation: str | None = field(
        default_factory=lambda: os.environ.get("OPFUSE_IMPLEMENTATION") or None
    )
    # "kernel": rand_like/rand (dropout) drawn inside the kernels that use them, from a
    # counter-based generator seeded by torch's; "torch": torch's own rand calls.
    random: str = field(default_factory=lambda: os.environ.get("OPFUSE_RANDOM") or "kernel")
    # "c": C with OpenMP (CPU tensors); "triton": Triton kernels (the interpreter runs them
    # on CPU tensors with TRITON_INTERPRET=1), library calls with torch; "auto": Triton
    # for graphs on a GPU, C otherwise.
    backend: str = field(default_factory=lambda: os.environ.get("OPFUSE_BACKEND") or "auto")

    def __post_init__(self) -> None:
        # Checked here, not where they are read: a compile that fails later falls back to
        # torch with a warning, and a misspelt option must be an error instead.
        for name, allowed in (
            ("random", ("kernel", "torch")),
            ("layout", ("channels-last", "keep")),
            ("backend", ("auto", "c", "triton")),
            ("implementation", (None, *IMPLEMENTATIONS)),
            ("fold_batchnorm", (True, False)),
            ("fuse_attention", (True, False)),
            ("freeze", (True, False)),
        ):
            env = f" (or {_ENV[name]})" if name in _ENV else ""
            check(f"Options.{name}{env}", getattr(self, name), allowed)
        if self.fuel is not None and (not isinstance(self.fuel, int) or self.fuel < 0):
            raise ValueError(
                f"Options.fuel (or OPFUSE_FUEL) must be a count >= 0, not {self.fuel!r}"
            )


# The environment variable behind each Options field that has one.
_ENV = {
    "fuel": "OPFUSE_FUEL",
    "debug_dir": "OPFUSE_DEBUG_DIR",
    "layout": "OPFUSE_LAYOUT",
    "implementation": "OPFUSE_IMPLEMENTATION",
    "random": "OPFUSE_RANDOM",
    "backend": "OPFUSE_BACKEND",
}


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {v!r}") from None


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
    """Everything after capture: rewrite, fuse, lower, render, build, tune, plan."""
    opts = options or Options()
    t0 = time.perf_counter()
    chosen, why = backend(graph, opts)
    triton = chosen == "triton"
    devices = ("cpu", "cuda") if triton else ("cpu",)  # where the backend's kernels run
    rw = rewrite(graph, opts, devices)
    graph = rw.graph
    kinds = classify(graph, devices)
    part = partition(graph, kinds, why_not_lowered, Fuel(opts.fuel))
    check_partition(graph, part)
    lowered = lower_groups(graph, part)
    module = build_triton(graph, lowered) if triton else build_module(graph, lowered)
    if module.problem:
        warn_once(module.problem.splitlines()[0])
    built, decisions = tune(graph, part, module, opts.implementation)
    plan = build_plan(graph, part, built)
    report = make_report(
        graph, part, lowered, built, decisions, eager_kernels, module.source, copied(graph, plan)
    )
    report.folds = [FoldReport(f.conv, f.batchnorm) for f in rw.folds]
    report.rejected = [RejectReport(r.producer, r.batchnorm, r.reason) for r in rw.refusals] + (
        report.rejected
    )
    report.layout = rw.layout
    report.attention = rw.attention
    report.random = rw.random
    report.constants = rw.constants
    report.pools = rw.pools
    report.backend = f"{chosen} ({why})"
    report.compile_seconds = time.perf_counter() - t0
    report.cached = module.cached
    if module.problem:
        report.warnings.append(module.problem)
    if opts.debug_dir:
        dump(opts.debug_dir, module.source, report)
    compiled = CompiledGraph(graph, Runtime(plan), report, module.source)
    release_freed_memory()
    return compiled


@dataclass
class Rewritten:
    graph: Graph
    folds: list[Fold]
    refusals: list[Refusal]  # BatchNorms not folded, and why
    layout: str  # the activation layout chosen for convolutions, and why
    attention: list[str]  # attentions fused into one call, or kept explicit and why
    random: list[str]  # uniform draws moved into kernels
    constants: list[str]  # ops on frozen constants alone, evaluated at compile time
    pools: list[str] = field(default_factory=list)  # pools computed as window reductions


def backend(graph: Graph, opts: Options) -> tuple[str, str]:
    """The backend that runs the graph's kernels, and why: Options.backend, "auto" resolved
    by where the graph's tensors live."""
    if opts.backend != "auto":
        return opts.backend, "Options.backend / OPFUSE_BACKEND"
    gpu = sorted(graph.devices - {"cpu"})
    if any(d.startswith("cuda") for d in gpu):
        return "triton", f"tensors on {', '.join(gpu)}"
    return "c", "tensors on the CPU"


def rewrite(graph: Graph, opts: Options, devices: tuple[str, ...] = ("cpu",)) -> Rewritten:
    folds: list[Fold] = []
    refusals: list[Refusal] = []
    if opts.fold_batchnorm:
        graph, folds, refusals = fold_batchnorm(graph)
    constants: list[str] = []
    graph = fold_constants(split_to_views(graph), constants)
    graph = lower_batchnorm(graph)
    graph = fold_constants(graph, constants)
    attention: list[str] = []
    if opts.fuse_attention:
        graph, attention = fuse_attention(graph)
    layout = ""
    if opts.layout == "channels-last":
        relaid = channels_last(graph)
        graph, layout = relaid.graph, relaid.note
    # after the layout pass: a pool over channels-last input reduces with lanes along C
    graph, pools = pools_in_kernels(graph, devices)
    random: list[str] = []
    if opts.random == "kernel":
        graph, random = random_in_kernels(graph, devices)
    graph = copies_in_kernels(graph)
    return Rewritten(graph, folds, refusals, layout, attention, random, constants, pools)


def tune(
    graph: Graph, part: Partition, module: Module, force: str | None = None
) -> tuple[dict[int, Built], dict[int, Decision]]:
    """Pick how each group runs: its only implementation, or the fastest measured one.
    Candidates are made one group at a time and the losers dropped before the next group,
    so the prepacked weights of all candidates never coexist."""
    built: dict[int, Built] = {}
    decisions: dict[int, Decision] = {}
    several = [g for g in part.groups if len(module.candidates.get(g.id, {})) > 1]
    noise = Noise()  # timing inputs for every group, from one random draw
    with Progress(len(several), "timing implementations") as bar:
        for g in part.groups:
            makers = module.candidates.get(g.id, {})
            if len(makers) <= 1:
                only = next(iter(_made(makers, makers).values()), None)
                if only is not None:
                    built[g.id] = only
                continue
            bar.update()
            identity = [g.pattern, *module.signatures.get(g.id, []), *_io_signature(graph, g)]
            key = decision_key([*identity, *sorted(makers)])
            d = Decision(force, {}) if force in makers else load_decision(key)
            cands = _made(makers, [d.choice]) if d is not None and d.choice in makers else {}
            timed = not cands
            if not cands:  # nothing remembered, or the library refused the remembered one
                cands = _made(makers, makers)
                if not cands:
                    continue  # every library refused: torch runs the group
                cands = {k: _donation_checked(graph, g.nodes, b) for k, b in cands.items()}
                d = choose(graph, g, cands, key, _sub_runtime, noise)
            assert d is not None
            log.getChild("autotune").debug("group %d (%s): %s", g.id, g.pattern, d.describe())
            decisions[g.id] = d
            chosen = cands.get(d.choice)
            del cands  # the losers' packed weights go now, not at the end of compile
            if chosen is not None:
                built[g.id] = chosen
            if timed:
                # The heap the timing freed (inputs, outputs, losers) goes back to the OS
                # now: glibc keeps it resident, and the next group's peak would stack on it.
                release_freed_memory()
    return built, decisions


def _made(makers: dict[str, Make], names: Iterable[str]) -> dict[str, Built | None]:
    """Make the named candidates (None: torch runs the group); one a library refuses is
    no candidate."""
    out: dict[str, Built | None] = {}
    for name in names:
        with contextlib.suppress(Unavailable):
            out[name] = makers[name]()
    return out


def _io_signature(graph: Graph, g: Any) -> list[str]:
    """Shapes, strides and dtypes of what the group reads and of the anchor call, and
    which of its inputs die with it (an in-place candidate is timed only over those)."""
    inside = set(g.nodes)
    out = []
    for n in g.nodes:
        out.append(f"{n.op}:{n.meta}")
        for i in n.inputs():
            if i not in inside:
                dies = ":dies" if _dies_with(graph, i, g.nodes) else ""
                out.append(f"in:{i.op}:{i.meta}{dies}")
    return out


def _donation_checked(graph: Graph, members: list[Any], b: Built | None) -> Built | None:
    """A library call that can write over its input keeps that variant only when the input
    dies with the group (the plan checks the rest): then the tuner times the in-place call,
    which is what will run. Other readers the group depends on run before it, so they do
    not keep the input alive (ResNet's block input feeds the block's first convolution and
    the residual add of its last)."""
    if not isinstance(b, BuiltCall) or b.inplace is None or b.donor is None:
        return b
    return (
        b if _dies_with(graph, b.inputs[b.donor], members) else replace(b, inplace=None, donor=None)
    )


def _dies_with(graph: Graph, d: Any, members: list[Any]) -> bool:
    """Is the group the last reader of value d (made by the graph, not an output)?"""
    if d.op in (INPUT, CONSTANT) or d in graph.output_set:
        return False
    inside = {m.name for m in members}
    return _run_before(graph, [u for u in graph.users[d] if u.name not in inside], members)


def _run_before(graph: Graph, readers: list[Any], members: list[Any]) -> bool:
    """Is every one of `readers` an ancestor of a member (so it runs before the group)?"""
    if not readers:
        return True
    index = graph.index
    lo = min(index[r] for r in readers)
    want = set(readers)
    seen: set[Any] = set()
    stack = [i for m in members for i in m.inputs()]
    while stack and want:
        x = stack.pop()
        if x in seen or index[x] < lo:
            continue
        seen.add(x)
        want.discard(x)
        stack.extend(x.inputs())
    return not want


class _InPlaceTiming:
    """Times a library call's in-place variant on the tuner's inputs, over a private copy
    of the input it writes (the plan only uses that variant on a dead torch result)."""

    def __init__(self, graph: Graph, b: BuiltCall) -> None:
        assert b.inplace is not None and b.donor is not None
        self.fn = b.inplace
        index = {n.name: k for k, n in enumerate(graph.inputs)}
        self.pos = [index[i.name] for i in b.inputs]
        self.donor = b.donor
        self.own: Any = None

    def __call__(self, inputs: list[Any]) -> Any:
        args = [inputs[p] for p in self.pos]
        if self.own is None:
            self.own = args[self.donor].clone()
        args[self.donor] = self.own
        return self.fn(*args)


def _sub_runtime(graph: Graph, part: Partition, built: Any) -> Any:
    b = built.get(0)
    if isinstance(b, BuiltCall) and b.inplace is not None:
        names = {n.name for n in graph.inputs}
        if all(i.name in names for i in b.inputs):  # (not through views the subgraph kept)
            return _InPlaceTiming(graph, b)
    return Runtime(build_plan(graph, part, built), guards=False)


def dump(directory: str, source: str, report: FusionReport) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{id(report) % 10000:04d}"
    (d / f"graph-{stamp}.c").write_text(source)
    (d / f"graph-{stamp}.txt").write_text(str(report) + "\n")
    (d / f"graph-{stamp}.json").write_text(report.to_json(indent=1))
