"""Profile-guided choice of how a fusion group runs.

An epilogue group can run as a blocked GEMM with the epilogue in cache, as oneDNN post-ops,
or unfused (library call, then the epilogue kernel). The first compile of a shape times each
candidate on inputs of the real shapes and keeps the fastest; the decision is stored in the
kernel cache directory, keyed by everything that could change it (the candidates' code,
shapes, thread count, CPU, torch version), so a warm compile does not time again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from .backends.base import Make, Module, Unavailable
from .decisions import (
    FUSED_MARGIN,
    MATERIALISING,
    REORDERING,
    Decision,
    decision_key,
    load_decision,
    save_decision,
)
from .fusion.groups import Group, Partition
from .ir.graph import CONSTANT, INPUT, Graph, GraphBuilder, Node, TensorMeta
from .ir.ops import Kind, info
from .ir.size import symbolic_text, undecided
from .ir.uses import used_outside
from .runtime.execute import Runtime
from .runtime.heap import release_freed_memory
from .runtime.plan import Absorbed, Built, BuiltCall, build_plan
from .tools.caches import last_level_bytes
from .tools.progress import Progress

log = logging.getLogger("opfuse.autotune")

REPS = 4  # samples per candidate, the first call's included (the fastest one counts)
MIN_SECONDS = 0.02  # and at least this much time per candidate (short kernels are noisy)
MAX_REPS = 200
# Long candidates (an LM head's GEMM, 300 ms a call) are not sampled REPS times: past
# BUDGET seconds of samples for a group, MIN_SAMPLES each are enough; and a candidate
# whose best sample is SLOWER times the leader's is no contender.
BUDGET = 0.2
MIN_SAMPLES = 2
SLOWER = 1.12
# Calls this long are sampled once: their one-time costs (page faults of a fresh output,
# tens of ms at most) are small beside them, and the load here drifts more between samples
# than a second one resolves (GPT-2 b8's LM head, 1024x768x50257: first / second call
# 997 / 883, 905 / 914, 760 / 716 ms, while one candidate read 905 ms in the first round
# and 746 in the second; its tuning took 8 s of an 11 s compile).
LONG_CALL = 0.5
# A loser is dropped only after this many samples: a library call that allocates its own
# output faults fresh heap pages in on its first calls (oneDNN bfloat16 linear
# 1024x768x3072: ~1600 faults on each of calls 1-3, 11.7 / 6.3 / 5.9 ms, then 3.4 ms).
DROP_AFTER = 3
# Sampling also stops, after SETTLE_AFTER samples, once the choice would stand with the
# chosen candidate SLACK slower (ResNet-50 batch 8: most groups' choice is clear on three
# samples; a fourth of the tuning time saved, and the close calls still get all REPS).
SETTLE_AFTER = 3
SLACK = 0.05
SEQUENTIAL_BYTES = 32 << 20  # candidates are timed one after the other above this


def penalised(anchor_op: str | None, intermediate_bytes: int) -> frozenset[str]:
    """The candidates of a group whose alone-timing flatters them: materialising ones
    while their intermediate fits in the last-level cache (larger, it makes its round trip
    to memory when timed alone too: linear+bias+gelu 2048x1024x4096 writes 32 MiB and ran
    118 ms unfused against 125 ms blocked in a model, as alone, yet the margin kept the
    blocked one); torch's call on a convolution (its weight reorder)."""
    out = frozenset(MATERIALISING) if _stays_cached(intermediate_bytes) else frozenset()
    return out | REORDERING if anchor_op == "aten.convolution.default" else out


def _stays_cached(nbytes: int) -> bool:
    """Does a value passed between kernels stay in cache when they are timed alone (and
    so flatter the kernels that write and read it back)?"""
    return nbytes <= last_level_bytes() // 2


def pick(seconds: Mapping[str, float], flattered: frozenset[str] = MATERIALISING) -> str:
    """The fastest candidate, unless it is one of `flattered` (see `penalised`) and
    another is within FUSED_MARGIN of it."""
    best = min(seconds, key=seconds.__getitem__)
    fused = {k: v for k, v in seconds.items() if k not in flattered}
    if best in flattered and fused:
        runner_up = min(fused, key=fused.__getitem__)
        if fused[runner_up] <= seconds[best] * FUSED_MARGIN:
            return runner_up
    return best


def subgraph(graph: Graph, members: Sequence[Node]) -> tuple[Graph, list[Node]]:
    """The group as a graph of its own: what it reads from outside becomes inputs (frozen
    constants stay constants; views of outside values are kept)."""
    inside = set(members)
    b = GraphBuilder().copy_from(graph)
    externals: list[Node] = []
    done: set[Node] = set()

    def bring(n: Node) -> None:
        if n in done or n in inside:
            return
        done.add(n)
        if n.op == CONSTANT:
            b.copy(n)
        elif info(n.op).kind == Kind.INJECTIVE and n.op != "getitem" and n.inputs():
            for i in n.inputs():
                bring(i)
            b.copy(n)
        else:
            new = b.add(INPUT, meta=n.meta, name=n.name)
            b.replace(n, new)
            externals.append(n)

    for m in members:
        for i in m.inputs():
            bring(i)
        b.copy(m)
    # What the group's kernel stores, by the lowering's rule: a value read only through a
    # view the group reads itself is no output (the GEMM in linear -> view -> gelu: made
    # one, torch computed it a second time and the blocked candidate timed twice its
    # cost). A tuple's components read outside make the tuple an output.
    outs = [
        m
        for m in members
        if (
            any(u not in inside for u in graph.users[m])
            if isinstance(m.meta, tuple)
            else used_outside(graph, m, inside)
        )
        or m in graph.output_set
    ]
    return b.build(outs), externals


class Noise:
    """Random timing inputs, cut from one buffer drawn once (a fixed seed: the same values
    on every compile) instead of drawn per group: drawing normal variates for every group's
    inputs took a fifth of ResNet-50's tuning time."""

    def __init__(self) -> None:
        self.base = torch.empty(0)

    def like(self, m: TensorMeta) -> torch.Tensor:
        # Filled through its storage: a layout with overlapping elements (an expanded
        # input, stride 0) cannot be written through the view.
        n = m.span
        if self.base.numel() < n:
            g = torch.Generator().manual_seed(0)
            self.base = torch.rand(n, generator=g) * 4 - 2  # grows to the largest input
        base = self.base[:n]
        if m.dtype.is_floating_point:
            vals = base.to(m.dtype)
        elif m.dtype == torch.bool:
            vals = base > 0
        else:
            vals = (base.abs() * 3.5 + 1).to(m.dtype)  # 1..7: safe divisors and indices
        return vals.clone().as_strided(m.shape, m.stride)


def settled(seconds: Mapping[str, float], flattered: frozenset[str] = MATERIALISING) -> bool:
    """Would `pick` choose the same with its choice SLACK slower than measured? (Noise
    only adds time: the others may yet get faster, which is the same.)"""
    if len(seconds) < 2:
        return True  # nothing to decide between
    choice = pick(seconds, flattered)
    slower = {k: v * (1 + SLACK) if k == choice else v for k, v in seconds.items()}
    return pick(slower, flattered) == choice


def time_candidates(
    candidates: Mapping[str, Callable[[], Any]],
    reps: int = REPS,
    beat: float | None = None,
    budget: float = BUDGET,
    done: Callable[[Mapping[str, float]], bool] | None = None,
) -> dict[str, float]:
    """Seconds per candidate: its fastest sample, interleaved (drift hits all alike); a
    candidate that raises is dropped. The fastest, not the median: the noise here only adds
    time, and most of it is not the candidate's (page faults when glibc hands a freed block
    back to the OS and the next allocation of any candidate faults it in again, ~2 us a
    page: 8 ms on a 25 MB output). Sampling stops at `reps` samples (and MIN_SECONDS
    each), or at MIN_SAMPLES once `budget` seconds are spent, or after the first calls when
    each took LONG_CALL or more; a candidate whose fastest sample (of DROP_AFTER or more)
    is SLOWER times the leader's (or `beat`, the best time of candidates timed earlier)
    stops being sampled. `done` (say, `settled`) ends sampling from SETTLE_AFTER samples
    (and MIN_SECONDS) on when it holds for the fastest samples so far."""
    alive = dict(candidates)
    samples: dict[str, list[float]] = {k: [] for k in alive}
    with torch.no_grad():
        for k in list(alive):
            t0 = time.perf_counter()
            try:
                alive[k]()
            except Exception:
                del alive[k]
                continue
            # The first call pays one-time costs (primitive creation, first touch of the
            # pool); as the first sample it costs nothing extra: the fastest one counts.
            samples[k].append(time.perf_counter() - t0)
        spent = sum(sum(v) for v in samples.values())
        n = 1
        if alive and all(samples[k][0] >= LONG_CALL for k in alive):
            return _fastest(samples)
        while alive and n < MAX_REPS:
            for k, fn in alive.items():
                t0 = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t0)
                spent += samples[k][-1]
            n += 1
            if n >= DROP_AFTER:
                _drop_losers(alive, samples, beat)
            if all(sum(samples[k]) >= MIN_SECONDS for k in alive) and (
                n >= reps or (done is not None and n >= SETTLE_AFTER and done(_fastest(samples)))
            ):
                break
            if n >= MIN_SAMPLES and spent >= budget:
                break
    return _fastest(samples)


def _fastest(samples: Mapping[str, list[float]]) -> dict[str, float]:
    return {k: min(v) for k, v in samples.items() if v}


def time_one_at_a_time(
    names: Sequence[str],
    runner: Callable[[str], Callable[[], Any]],
    budget: float = BUDGET,
    done: Callable[[Mapping[str, float]], bool] | None = None,
) -> dict[str, float]:
    """Seconds per candidate when only one may be alive at a time (`runner(name)` makes
    it; it is dropped before the next is made). Two rounds, the second in reverse order
    over the first round's losers, each candidate's fastest sample of both counting: a
    burst of load during one candidate's turn no longer decides alone (a cached decision
    read "oneDNN 14.2 ms, unfused 6.7 ms" for a group that runs in 2.5 ms fused, 4.1 ms
    unfused). In the second round `done` sees every candidate's fastest sample so far."""
    seconds: dict[str, float] = {}
    share = budget / (2 * len(names))  # the budget, over both rounds
    for second in (False, True):
        turn = list(names)
        if second:
            # Noise only adds time: a burst can make the fastest candidate look slow, never
            # a slow one fast. The second round re-times the ones that lost the first.
            lead = min(seconds, key=seconds.__getitem__, default=None)
            turn = [n for n in reversed(names) if n in seconds and n != lead]
        for name in turn:
            run = runner(name)
            beat = min(seconds.values(), default=None)
            check = None
            if second and done is not None:
                check = functools.partial(_done_with, done, seconds, name)
            got = time_candidates({name: run}, beat=beat, budget=share, done=check)
            del run
            if name in got:
                seconds[name] = min(got[name], seconds.get(name, got[name]))
    return seconds


def _done_with(
    done: Callable[[Mapping[str, float]], bool],
    earlier: Mapping[str, float],
    name: str,
    now: Mapping[str, float],
) -> bool:
    merged = dict(earlier)
    if name in now:
        merged[name] = min(now[name], merged.get(name, now[name]))
    return done(merged)


def _drop_losers(
    alive: dict[str, Callable[[], Any]], samples: dict[str, list[float]], beat: float | None
) -> None:
    best = [min(samples[k]) for k in alive]
    if beat is not None:
        best.append(beat)
    if len(best) < 2:
        return
    lead = min(best)
    for k in list(alive):
        if min(samples[k]) > SLOWER * lead:
            del alive[k]


def choose(
    graph: Graph,
    group: Group,
    candidates: Mapping[str, Any],
    key: str,
    run_plan: Callable[[Graph, Partition, Mapping[int, Any]], Callable[[list[Any]], Any]],
    noise: Noise | None = None,
) -> Decision:
    """Time each candidate implementation of `group` (Built objects for plan.build_plan,
    None for torch) on random inputs of its shapes; return the fastest and remember it
    under `key`."""
    noise = noise or Noise()
    sub, externals = subgraph(graph, group.nodes)
    by_name = {n.name: n for n in sub.nodes}
    part = Partition([_copied(group, by_name)])
    inputs = [noise.like(n.tensor) for n in externals]
    working_set = sum(t.numel() * t.element_size() for t in inputs) + sum(
        o.tensor.nbytes for o in sub.output_set
    )
    a = group.anchor
    flattered = penalised(a.op if a else None, a.tensor.nbytes if a else 0)
    done = functools.partial(settled, flattered=flattered)
    if working_set <= SEQUENTIAL_BYTES:
        runners = {}
        for name, built in candidates.items():
            run = run_plan(sub, part, {0: built} if built is not None else {})
            runners[name] = functools.partial(run, inputs)
        seconds = time_candidates(runners, done=done)
    else:
        # Big tensors: one candidate (and its memory pool) alive at a time, so compiling
        # never holds several copies of a large intermediate.
        def runner(name: str, args: list[Any] = inputs) -> Callable[[], Any]:
            built = candidates[name]
            run = run_plan(sub, part, {0: built} if built is not None else {})
            return functools.partial(run, args)

        seconds = time_one_at_a_time(list(candidates), runner, done=done)
        del runner
    del inputs
    if not seconds:
        return Decision(next(iter(candidates)), {})
    decision = Decision(pick(seconds, flattered), seconds)
    save_decision(key, decision)
    return decision


def tune(
    graph: Graph, part: Partition, module: Module, force: str | None = None
) -> tuple[dict[int, Built], dict[int, Decision]]:
    """Pick how each group runs: its only implementation, or the fastest measured one.
    Candidates are made one group at a time and the losers dropped before the next group,
    so the prepacked weights of all candidates never coexist."""
    built: dict[int, Built] = {}
    decisions: dict[int, Decision] = {}

    def own(gid: int) -> dict[str, Make]:  # the candidates that do the group's work alone
        cands = module.candidates.get(gid, {})
        return {k: v for k, v in cands.items() if (gid, k) not in module.absorbs}

    several = [g for g in part.groups if len(own(g.id)) > 1]
    noise = Noise()  # timing inputs for every group, from one random draw
    with Progress(len(several), "timing implementations") as bar:
        for g in part.groups:
            makers = own(g.id)
            if len(makers) <= 1:
                only = next(iter(_made(makers, makers).values()), None)
                if only is not None:
                    built[g.id] = only
                continue
            bar.update()
            # Sizes print as their symbols (ir/size.py): every size of a graph with
            # symbolic sizes takes the choice its first size measured.
            with symbolic_text():
                io = _io_signature(graph, g)
            identity = [g.pattern, *module.signatures.get(g.id, []), *io]
            key = decision_key([*identity, *sorted(makers)])
            d = Decision(force, {}) if force in makers else load_decision(key)
            cands = _made(makers, [d.choice]) if d is not None and d.choice in makers else {}
            timed = not cands
            if not cands:  # nothing remembered, or the library refused the remembered one
                cands = _made(makers, makers)
                if not cands:
                    continue  # every library refused: torch runs the group
                cands = {k: _donation_checked(graph, g.nodes, b) for k, b in cands.items()}
                with undecided():  # (a cost: every candidate computes any size)
                    d = choose(graph, g, cands, key, _sub_runtime, noise)
            assert d is not None
            log.debug("group %d (%s): %s", g.id, g.pattern, d.describe())
            decisions[g.id] = d
            chosen = cands.get(d.choice)
            del cands  # the losers' packed weights go now, not at the end of compile
            if chosen is not None:
                built[g.id] = chosen
            if timed:
                # The heap the timing freed (inputs, outputs, losers) goes back to the OS
                # now: glibc keeps it resident, and the next group's peak would stack on it.
                release_freed_memory()
    # the candidates doing the work of groups before theirs: pairs first, then triples
    # (which are timed against what the pairs decided)
    for (gid, name), producers in sorted(module.absorbs.items(), key=lambda kv: len(kv[1])):
        _pair(graph, part, module, (producers, gid, name), built, decisions, force, noise)
    return built, decisions


def _pair(
    graph: Graph,
    part: Partition,
    module: Module,
    job: tuple[tuple[int, ...], int, str],
    built: dict[int, Built],
    decisions: dict[int, Decision],
    force: str | None,
    noise: Noise,
) -> None:
    """Run groups `producers` and `last` as candidate `name` of the last, which does the
    work of all (lower/dw_gemm.py), when that is forced or measures faster than the groups
    as each was chosen to run."""
    producers, last, name = job
    if force is not None and force != name:
        return  # another implementation forced: the groups run as forced
    if isinstance(built.get(last), Absorbed):
        return  # another kernel does this group's work already
    for p in producers:
        b = built.get(p)
        if isinstance(b, Absorbed) and b.into != last:
            return  # another kernel does this group's work already
        if any(isinstance(o, Absorbed) and o.into == p for o in built.values()):
            return  # its kernel does other groups' work too (a chain of blocks: one each)
    try:
        fused = module.candidates[last][name]()
    except Unavailable:
        return
    if fused is None:
        return
    ids = [*producers, last]
    if force == name:
        d = Decision(name, {})
    else:
        groups = {g.id: g for g in part.groups}
        chosen = [decisions[i].choice if i in decisions else "only" for i in ids]
        with symbolic_text():
            io = [x for i in ids for x in _io_signature(graph, groups[i])]
        sigs = [x for i in ids for x in module.signatures.get(i, [])]
        key = decision_key(["pair", name, *sigs, *io, *chosen])
        remembered = load_decision(key)
        if remembered is not None:
            d = remembered
        else:
            with undecided():
                d = _time_pair(
                    graph, [groups[i] for i in ids], [built.get(i) for i in ids], fused, noise
                )
            save_decision(key, d)
    if d.choice == name:
        built[last] = fused
        for p in producers:
            built[p] = Absorbed(last)
        decisions[last] = d


def _time_pair(
    graph: Graph, groups: list[Group], chosen: list[Any], fused: Any, noise: Noise
) -> Decision:
    """Time the groups as chosen ("separate") against the candidate that does them all."""
    members = [n for g in groups for n in g.nodes]
    sub, externals = subgraph(graph, members)
    by_name = {n.name: n for n in sub.nodes}
    one = Partition([_copied(groups[-1], by_name, nodes=members)])
    apart = Partition([_copied(g, by_name, i) for i, g in enumerate(groups)])
    runs = {i: b for i, b in enumerate(chosen) if b is not None}
    inputs = [noise.like(n.tensor) for n in externals]
    name = fused.kernel.implementation
    runners = {
        name: functools.partial(Runtime(build_plan(sub, one, {0: fused}), guards=False), inputs),
        "separate": functools.partial(Runtime(build_plan(sub, apart, runs), guards=False), inputs),
    }
    # Timed alone, the values the separate groups pass between them stay in cache; inside
    # a model they make their round trip to memory: the fused candidate wins by a margin.
    passed = max(g.nodes[-1].tensor.nbytes for g in groups[:-1])
    flattered = frozenset({"separate"}) if _stays_cached(passed) else frozenset()
    seconds = time_candidates(runners, done=functools.partial(settled, flattered=flattered))
    del runners, inputs
    release_freed_memory()
    if not seconds:
        return Decision("separate", {})
    return Decision(pick(seconds, flattered), seconds)


def _copied(
    g: Group, by_name: Mapping[str, Node], gid: int = 0, nodes: Sequence[Node] | None = None
) -> Group:
    """Group g (or its pattern and anchor over `nodes`) in a sub-graph: its nodes by name."""
    anchor = by_name[g.anchor.name] if g.anchor else None
    return Group(gid, [by_name[n.name] for n in (nodes or g.nodes)], g.pattern, anchor)


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
