"""`torch.compile(model, backend="opfuse")`: AOTAutograd splits forward and backward into
ATen graphs and opfuse compiles each one. Registered through the `torch_dynamo_backends`
entry point, so it works without importing opfuse first."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._dynamo.exc import RestartAnalysis
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..ir.size import PREFIX
from ..options import Options
from ..pipeline import CompiledGraph, compile_graph, compile_graphs, warn_once
from ..report.make import count_kernels
from ..report.tables import FusionReport
from ..rewrite.fx_layout import channels_last_convolutions
from ..runtime.heap import collector_paused
from ..runtime.sized import check, note, serve, unserved
from . import sizes
from .convert import capture_fx
from .decompose import decompositions, keep_whole
from .dynamic import has_symbols, install, split_static, static_share, symbols
from .replay import Facts, learn, twice_differentiable
from .watch import FrozenInputs

log = logging.getLogger("opfuse")

# Reports of graphs compiled while collect_reports() listens, on any thread: autograd runs a
# GPU graph's backward, and compiles it, on the device's own thread.
_sinks: list[list[FusionReport]] = []
_sinks_lock = threading.Lock()


def _report(report: FusionReport) -> None:
    with _sinks_lock:
        for sink in _sinks:
            sink.append(report)


@contextlib.contextmanager
def listening() -> Iterator[list[FusionReport]]:
    """The reports of every graph compiled inside, on whichever thread."""
    sink: list[FusionReport] = []
    with _sinks_lock:
        _sinks.append(sink)
    try:
        yield sink
    finally:
        with _sinks_lock:
            _sinks[:] = [s for s in _sinks if s is not sink]


# Input signatures one graph compiles for, by default: dynamo hands graphs with symbolic
# sizes after a recompile (automatic dynamic), and each new size is a compile of its own.
CACHE_LIMIT = 8
# A graph with symbolic sizes compiled per size: its sizes share kernels, tuning and packed
# weights (ir/size.py, execute.Packed), so a size costs its plan's memory pool and about
# half a second of compiling (BERT-base: 2-25 MB). More of them are kept, while their pools
# stay under POOL_BUDGET bytes together.
SIZES_LIMIT = 64
POOL_BUDGET = 1 << 30

_compiled = [0]  # graphs compiled in this process


def compiles() -> int:
    """How many compiles the backend ran in this process: one per graph with static sizes,
    one for all static regions of a graph with symbolic sizes, one per size of a graph
    compiled per size."""
    return _compiled[0]


class _GraphRunner:
    """Runs one AOT graph with opfuse, specialising on input shapes and strides (dynamo
    may hand us graphs with symbolic sizes; each concrete signature compiles once, up to
    `cache_limit` of them; later ones run the graph with torch)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        options: Options,
        cache_limit: int = CACHE_LIMIT,
        fallback: Callable[[list[Any]], Any] | None = None,
        compile_now: bool = True,
        static: frozenset[int] = frozenset(),
        budget: int | None = None,
        frozen: frozenset[int] = frozenset(),
    ) -> None:
        self.gm = gm
        self.static = static  # inputs that are parameters (capture_fx)
        # parameters compiled in as constants (an inference graph's): each compile serves
        # the calls that pass the same tensors, unchanged (watch.FrozenInputs)
        self.frozen = frozen
        self.watches: dict[tuple[Any, ...], FrozenInputs] = {}
        self._live_at: list[int] = []
        self._live_for: tuple[int, frozenset[int]] = (-1, frozenset())  # (n, frozen) of _live_at
        self._first_frozen = 0  # (of the frozen positions, the first: _key)
        self.changes = 0  # compiles again because a frozen parameter changed
        self.fallback = fallback
        self.options = options
        self.cache_limit = cache_limit
        self.budget = budget  # bytes of memory pools the kept signatures may hold together
        self.pooled = 0
        self.cache: dict[tuple[Any, ...], tuple[CompiledGraph, list[int]] | None] = {}
        self.served: list[tuple[Any, ...]] = []  # keys served by another's compile, oldest first
        # (frozen parameters need their values: AOTAutograd's example inputs are fake)
        if compile_now and not frozen and not has_symbols(example_inputs) and cache_limit > 0:
            self._compile([_unit_strides(a) for a in example_inputs])

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The signature of a call: the arguments' sizes, strides, dtypes and devices, but
        the frozen parameters' (the same tensors, unchanged, or the watch compiles again:
        keying MobileNetV2's 262 of them cost 0.35 ms a call). Those are told apart by the
        first one's identity: dynamo hands every instance of a model class the same graph,
        and each instance's parameters are compiled in apart (its watch holds the tensor,
        so no other takes its id)."""
        key = tuple(
            (tuple(a.shape), tuple(a.stride()), a.dtype, str(a.device))
            if isinstance(a, torch.Tensor)
            else ("value", a)
            for a in (args if not self.frozen else [args[k] for k in self._live(len(args))])
        )
        return (*key, id(args[self._first_frozen])) if self.frozen else key

    def _live(self, n: int) -> list[int]:
        """The positions of the n arguments that are not frozen."""
        if self._live_for[0] != n or self._live_for[1] is not self.frozen:
            self._live_at = [k for k in range(n) if k not in self.frozen]
            self._live_for = (n, self.frozen)
            self._first_frozen = min(self.frozen, default=0)
        return self._live_at

    def _compile(
        self, args: Sequence[Any], given: Sequence[Any] | None = None, why: Sequence[str] = ()
    ) -> tuple[CompiledGraph, list[int]] | None:
        """`given`: the arguments as they came (the frozen ones are watched as such).
        `why`: why no earlier compile served these sizes (_serve), for the report."""
        _compiled[0] += 1
        entry: tuple[CompiledGraph, list[int]] | None
        try:
            # AOTAutograd may call the compiler with its fake-tensor mode still active:
            # constant folding and autotuning compute with real tensors.
            with unset_fake_temporarily(), collector_paused():
                graph, positions = capture_fx(self.gm, args, self.static, self.frozen)
                compiled = compile_graph(graph, self.options, count_kernels(graph))
            decided = note(compiled)
            if decided is not None:  # (a size of a graph with symbolic sizes)
                compiled.report.dynamic.append(decided)
            compiled.report.dynamic += why
            entry = (compiled, positions)
        except Exception as e:  # never crash a model eager runs: run this graph with torch
            warn_once(f"opfuse: graph falls back to torch ({type(e).__name__}: {e})")
            entry = None
        self.keep(args, entry)
        if entry is not None and self.frozen:
            self.watches[self._key(args)] = FrozenInputs(sorted(self.frozen), given or args)
        return entry

    def _serve(
        self, args: Sequence[Any], given: Sequence[Any], why: list[str], evict: bool = False
    ) -> tuple[CompiledGraph, list[int]] | None:
        """These sizes served by a compile of the graph at others whose decisions hold at
        them (runtime/sized.py): no capture, no compile. Appends to `why` what each
        compile tried decides otherwise here. `evict` (the cache is full): in place of
        the size served longest ago, if there is one (_give_way)."""
        if not any(e is not None and e[0].decisions for e in self.cache.values()):
            return None
        fx = self.gm.graph
        if fx.find_nodes(op="call_function", target=torch.ops.aten._assert_scalar.default):
            return None  # (what the graph asserts of its sizes is checked as it runs)
        symbols = [n.meta.get("val") for n in fx.find_nodes(op="placeholder")]
        values = {PREFIX + k: v for k, v in sizes.bind(symbols, args).items()}
        tried: set[int] = set()
        for key, e in list(self.cache.items()):
            if e is None or id(e[0].decisions) in tried:
                continue
            watch = self.watches.get(key)
            if self.frozen and (watch is None or not watch.holds(given)):
                continue  # (its frozen parameters changed since: compiled again, below)
            tried.add(id(e[0].decisions))
            served = serve(e[0], values)
            if served is None:
                why.append(unserved(e[0], values))
                continue
            check(served, functools.partial(self._compile_here, args))
            entry = (served, e[1])
            if evict and not self._give_way():
                return None
            self.keep(args, entry)
            self.served.append(self._key(args))
            if self.frozen:
                self.watches[self._key(args)] = FrozenInputs(sorted(self.frozen), given)
            return entry
        return None

    def _compile_here(self, args: Sequence[Any]) -> CompiledGraph:
        """The graph compiled at `args`' sizes, kept nowhere (sized.check)."""
        with unset_fake_temporarily(), collector_paused():
            graph, _ = capture_fx(self.gm, args, self.static, self.frozen)
            return compile_graph(graph, self.options)

    def _room(self) -> bool:
        """May another signature be kept (cache_limit, and the pools' budget)?"""
        return len(self.cache) < self.cache_limit and (
            self.budget is None or self.pooled < self.budget
        )

    def _give_way(self) -> bool:
        """Drop the signature served longest ago (served again in milliseconds should it
        come back), if there is one: a full cache then keeps a new size, never more."""
        if not self.served:
            return False
        old = self.served.pop(0)
        gone = self.cache.pop(old, None)
        self.pooled -= sum(gone[0].run.plan.pool_sizes) if gone is not None else 0
        self.watches.pop(old, None)
        return True

    def keep(self, args: Sequence[Any], entry: tuple[CompiledGraph, list[int]] | None) -> None:
        """Serve calls with `args`' signature by `entry` (None: with torch)."""
        key = self._key(args)
        old = self.cache.get(key)
        if old is not None:  # compiled again (a frozen parameter changed)
            self.pooled -= sum(old[0].run.plan.pool_sizes)
        self.cache[key] = entry
        if entry is not None:
            self.pooled += sum(entry[0].run.plan.pool_sizes)
            _report(entry[0].report)

    def _changed(self, key: tuple[Any, ...], args: list[Any], given: list[Any]) -> Any:
        """A parameter compiled in as a constant was replaced or changed since (or
        opfuse.refresh() was called): compile again from the live values; after
        FREEZE_CHANGES of those, stop freezing (a model evaluated between training
        steps) and compile with the parameters as inputs."""
        self.changes += 1
        if self.changes > FREEZE_CHANGES:
            warn_once(
                f"opfuse: the parameters of an inference graph changed {FREEZE_CHANGES} "
                "times since it was compiled with them as constants; it now reads them as "
                "inputs (no BatchNorm folding, no prepacked convolutions)"
            )
            self.frozen = frozenset()
            self.cache, self.watches, self.pooled, self.served = {}, {}, 0, []
        else:
            warn_once(
                "opfuse: a parameter an inference graph was compiled with as a constant "
                "changed (or opfuse.refresh() was called): compiling it again"
            )
        self.watches.pop(key, None)
        return self._compile(args, given)

    def _new_size(
        self, args: list[Any], given: list[Any]
    ) -> tuple[CompiledGraph, list[int]] | None:
        """A signature not in the cache: served by an earlier compile, compiled, or (the
        cache full) None, run with torch."""
        why: list[str] = []  # why no compile served these sizes, for the new one's report
        entry = self._serve(args, given, why, evict=not self._room())
        if entry is None and (self._room() or self._give_way()):
            return self._compile(args, given, why)
        if entry is None:
            rest = (
                "its static parts fused, the rest with torch"
                if self.fallback is not None
                else "with torch, unfused"
            )
            full = (
                f"{self.cache_limit} input shapes (cache_limit)"
                if len(self.cache) >= self.cache_limit
                else f"{len(self.cache)} input shapes, whose memory pools reach "
                f"{self.pooled >> 20} MiB"
            )
            warn_once(
                f"opfuse: a graph was compiled for {full}; new ones run {rest}. Pad or "
                "bucket the inputs to a few "
                "sizes, or raise the limit: torch.compile(..., backend='opfuse', "
                "options={'cache_limit': n})"
            )
        return entry

    def __call__(self, given: list[Any]) -> Any:
        if self.frozen:  # (compiled in: their strides are not keyed, nor read)
            args = list(given)
            for k in self._live(len(given)):
                args[k] = _unit_strides(given[k])
        else:
            args = [_unit_strides(a) for a in given]
        key = self._key(args)
        if key in self.cache:
            entry = self.cache[key]
            watch = self.watches.get(key)
            if watch is not None and not watch.holds(given):
                entry = self._changed(key, args, given)
        else:
            entry = self._new_size(args, given)
        if entry is None:
            return self.fallback(args) if self.fallback is not None else self.gm(*args)
        compiled, positions = entry
        return compiled([args[k] for k in positions])


def _unit_strides(t: Any) -> Any:
    """t with the strides of its size-1 dims made what a dense layout would give them: they
    never enter an address, and torch leaves them to chance (an attention output's
    (1, 12, 1, 64) comes with stride 768 or 64 there), which must not make a new
    signature."""
    if not isinstance(t, torch.Tensor) or 1 not in t.shape:
        return t
    stride = list(t.stride())
    inner = 1
    for d in reversed(range(t.dim())):
        if t.shape[d] == 1:
            stride[d] = inner
        inner = stride[d] * max(t.shape[d], 1)
    return t if tuple(stride) == t.stride() else t.as_strided(t.shape, stride)


def _compiler(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Options | None = None,
    cache_limit: int | None = None,
    static: frozenset[int] = frozenset(),
    frozen: frozenset[int] = frozenset(),
) -> Callable[..., Any]:
    """`static`: the inputs that are the model's parameters and buffers, in an inference
    graph (opfuse's GEMM keeps a packed copy of such a weight, packed again when it
    changes); `frozen`: those the graph does not write, compiled in as constants where its
    sizes are static. `cache_limit` None: CACHE_LIMIT, or SIZES_LIMIT and POOL_BUDGET for
    a graph with symbolic sizes."""
    from torch._functorch.aot_autograd import make_boxed_func

    opts = options or Options(freeze=False)
    fallback = None
    symbolic = has_symbols(example_inputs)
    budget = POOL_BUDGET if symbolic and cache_limit is None else None
    if cache_limit is None:
        cache_limit = SIZES_LIMIT if symbolic else CACHE_LIMIT
    if symbolic:
        generic = _Generic(gm, opts, static)
        share = static_share(gm)
        if share >= GENERIC_SHARE:
            return make_boxed_func(lambda *a: generic(list(a)))
        fallback = generic
        _tell(
            f"graph with symbolic sizes ({', '.join(symbols(gm)) or 'strides'}): "
            f"{share:.0%} of its ops have static sizes, so a size compiles, with the sizes "
            "as arguments of its kernels, and serves every later size at which its "
            f"decisions on the sizes come out the same; {cache_limit} sizes kept (sizes "
            "whose size-dependent choices agree share one build and the first size's "
            "tuning); one compile of its static regions serves the sizes past them"
        )
    runner = _GraphRunner(
        gm,
        example_inputs,
        opts,
        cache_limit,
        fallback,
        static=static,
        budget=budget,
        frozen=frozen,
    )
    return make_boxed_func(lambda *a: runner(list(a)))


# An inference graph compiled with its parameters as constants compiles again when one
# changes; after this many changes it reads them as inputs instead.
FREEZE_CHANGES = 3

# A graph with symbolic sizes compiles once, for every size, when at least this share of its
# ops have static sizes (a decode step: all but attention over the cache); below it, fusing
# the symbolic rest matters more, and each size compiles as a static graph of its own, up
# to the cache limit (the generic compile then serves the sizes past it).
GENERIC_SHARE = 0.5


def _tell(note: str) -> None:
    """Log a note on symbolic sizes and put it in the reports being collected."""
    log.info("%s", note)
    _report(FusionReport(dynamic=[note]))


class _Generic:
    """A graph with symbolic sizes compiled once: its static regions by opfuse, the rest
    run with torch (frontend/dynamic.py). Split on the first call."""

    def __init__(
        self, gm: torch.fx.GraphModule, options: Options, static: frozenset[int] = frozenset()
    ) -> None:
        self.gm, self.options, self.static = gm, options, static
        self.run: Callable[..., Any] | None = None

    def __call__(self, args: list[Any]) -> Any:
        if self.run is None:
            self.run = self._split()
        return self.run(*args)

    def _split(self) -> Callable[..., Any]:
        split = split_static(self.gm, self.static)
        ops = split.dynamic_ops
        shown = ", ".join(ops[:8]) + (", ..." if len(ops) > 8 else "")
        note = (
            f"graph with symbolic sizes ({', '.join(split.symbols) or 'strides'}): "
            f"{len(split.regions)} static regions compiled once for every size; "
            f"{len(ops)} ops whose sizes depend on them run with torch"
            + (f" ({shown})" if ops else "")
        )
        _tell(note)
        install(split, compile_regions(split.regions, self.options, split.static))
        return split.module.forward


def compile_regions(
    regions: dict[str, tuple[torch.fx.GraphModule, list[Any]]],
    options: Options,
    static: dict[str, frozenset[int]],
) -> dict[str, _GraphRunner]:
    """The static regions of one graph compiled together: one compile, their kernels one
    library. A region that does not capture runs with torch; if the joint compile fails,
    each region compiles alone (and falls back to torch alone)."""
    runners = {
        name: _GraphRunner(
            sub, ex, options, 1, compile_now=False, static=static.get(name, frozenset())
        )
        for name, (sub, ex) in regions.items()
    }
    if not runners:
        return runners
    _compiled[0] += 1
    captured: dict[str, tuple[list[Any], Any, list[int]]] = {}
    with unset_fake_temporarily():
        for name, (sub, examples) in regions.items():
            args = [_unit_strides(a) for a in examples]
            try:
                graph, positions = capture_fx(sub, args, runners[name].static)
            except Exception as e:
                warn_once(f"opfuse: a static region falls back to torch ({type(e).__name__}: {e})")
                runners[name].keep(args, None)
                continue
            captured[name] = (args, graph, positions)
        graphs = [g for _, g, _ in captured.values()]
        try:
            compiled = compile_graphs(graphs, options, [count_kernels(g) for g in graphs])
        except Exception as e:
            log.debug("joint compile failed (%s: %s): regions compile alone", type(e).__name__, e)
            for name, (args, _, _) in captured.items():
                runners[name]._compile(args)
            return runners
    for (name, (args, _, positions)), c in zip(captured.items(), compiled):
        runners[name].keep(args, (c, positions))
    return runners


def _forward_compiler(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    facts: Facts,
    options: Options | None = None,
    cache_limit: int | None = None,
) -> Callable[..., Any]:
    """The forward's compiler. It also tells AOTAutograd that the backward donates no saved
    tensor: the runtime reuses one only when nothing else holds it (reference counts), so
    backward(retain_graph=True) stays legal. With donations listed, AOTAutograd refuses it
    once the backward has been compiled by a plain backward() (inductor's compiled
    backward happens to list none here). And it notes whether the graph can be replayed
    for a double backward (replay.py)."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is not None and hasattr(meta, "bw_donated_idxs"):
        meta.bw_donated_idxs = []
    learn(facts, gm)
    static: frozenset[int] = frozenset()
    frozen: frozenset[int] = frozenset()
    if meta is not None and not getattr(meta, "traced_tangents", [None]):
        # An inference graph (no gradient flows back): its parameters are inputs the
        # caller passes unchanged from call to call, where a training step moves them all.
        # Those the graph does not write (a BatchNorm's running statistics in training
        # mode) are frozen in as an eval-mode opfuse.compile freezes them.
        static = frozenset(getattr(meta, "static_input_indices", None) or ())
        info = getattr(meta, "input_info", None) or []
        written = {i for i, x in enumerate(info) if x.mutates_data or x.mutates_metadata}
        frozen = static - written
    return _compiler(gm, example_inputs, options, cache_limit, static, frozen)


def opfuse_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Options | dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """The torch.compile backend: forward and backward graphs both go through opfuse.
    `torch.compile(..., options={...})` takes `cache_limit` (input shapes compiled per
    graph; by default CACHE_LIMIT, or SIZES_LIMIT within POOL_BUDGET for a graph with
    symbolic sizes) and the fields of opfuse.Options; `backend_for` gives it an Options."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    opts, cache_limit = backend_options(options or {})

    def partition(joint: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        _save_compared(joint.graph)
        return min_cut_rematerialization_partition(joint, *args, **kwargs)

    facts = Facts()
    backend = aot_autograd(
        fw_compiler=functools.partial(
            _forward_compiler, facts=facts, options=opts, cache_limit=cache_limit
        ),
        bw_compiler=functools.partial(_compiler, options=opts, cache_limit=cache_limit),
        decompositions=decompositions(),
        partition_fn=partition,
    )
    relaid = channels_last_convolutions(gm)
    with keep_whole():
        if relaid is not None:
            try:
                return twice_differentiable(backend(relaid, example_inputs), relaid, facts)
            except RestartAnalysis:  # dynamo's own signal (specialise a scalar, trace again)
                raise
            except Exception as e:  # a view only NCHW allows: trace the graph as it was
                log.debug("channels-last declined: %s: %s", type(e).__name__, e)
        return twice_differentiable(backend(gm, example_inputs), gm, facts)


def backend_options(given: Options | Mapping[str, Any]) -> tuple[Options, int | None]:
    """torch.compile's `options` for this backend (a dict, or the Options of an
    opfuse.compile that goes through torch.compile), checked: (Options, cache_limit or None
    for the defaults). The backend's graphs take the parameters as inputs: never frozen."""
    if isinstance(given, Options):
        return dataclasses.replace(given, freeze=False), None
    cache_limit = given.get("cache_limit") if isinstance(given, Mapping) else None
    if cache_limit is not None and (not isinstance(cache_limit, int) or cache_limit < 0):
        raise ValueError(f"opfuse backend: cache_limit must be a count >= 0, not {cache_limit!r}")
    return Options.of(given, "opfuse backend", extra=("cache_limit",), freeze=False), cache_limit


def _save_compared(graph: torch.fx.Graph) -> None:
    """Forward values the backward compares with == (amax/amin's backward finds the saved
    maximum again in its input) are saved, never recomputed: a recomputation is a different
    kernel, and glibc's vector and scalar sin/tanh/... may round one element differently
    than the forward did. Nothing would match, and the gradient would be 0/0."""
    from torch.utils.checkpoint import CheckpointPolicy

    backward: set[torch.fx.Node] = set()  # what depends on the incoming gradients
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(
            a in backward for a in n.all_input_nodes
        ):
            backward.add(n)
    feeds: set[torch.fx.Node] = set()  # forward values the backward reads
    for n in reversed(graph.nodes):
        if any(u in backward or u in feeds for u in n.users):
            feeds.add(n)
    for n in graph.nodes:
        if n.target is torch.ops.aten.eq.Tensor and n in feeds and n not in backward:
            for a in n.all_input_nodes:
                val = a.meta.get("val")
                if isinstance(val, torch.Tensor) and val.is_floating_point():
                    a.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def backend_for(options: Options | None) -> Callable[..., Any]:
    """opfuse's backend with these Options (torch.compile's own `options` take a dict)."""
    return functools.partial(opfuse_backend, options=options)


def collect_reports(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backward: bool = False,
    options: Options | None = None,
) -> FusionReport:
    """Run `model` once under torch.compile with opfuse's backend and `options` (and, with
    `backward`, the backward of the sum of its outputs that require grad) and merge the
    reports of every graph compiled meanwhile."""
    with listening() as sinks:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend_for(options))
        out = compiled(*args, **kwargs)
        if backward:
            from .structure import flatten

            leaves = [t for t in flatten(out)[0] if t.requires_grad]
            if leaves:
                torch.autograd.backward([t.sum() for t in leaves])
    report = FusionReport()
    for r in sinks:
        report = report.merge(r)
    return report
