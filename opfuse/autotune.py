"""Profile-guided choice of how a fusion group runs.

An epilogue group can run as a blocked GEMM with the epilogue in cache, as oneDNN post-ops,
or unfused (library call, then the epilogue kernel). The first compile of a shape times each
candidate on inputs of the real shapes and keeps the fastest; the decision is stored in the
kernel cache directory, keyed by everything that could change it (the candidates' code,
shapes, thread count, CPU, torch version), so a warm compile does not time again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .fusion.groups import Group, Partition
from .ir.graph import CONSTANT, INPUT, Graph, GraphBuilder, Node, TensorMeta
from .ir.ops import Kind, info
from .lower.lowering import used_outside

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
# Part of every decision's key: a change to how candidates are timed or run (the estimator,
# an in-place variant) makes decisions remembered under the old rules stale.
TUNER_VERSION = "10"
# Candidates that write the library's result to memory and read it back for the epilogue.
# Timed alone, their intermediate stays in cache between the two kernels; inside a model it
# evicts the data the next groups read, so they win only by a margin (ResNet-50 batch 8:
# five 3x3 convolutions + ReLU timed 1-5% faster unfused, yet the model ran 6.5% faster
# with every group fused).
MATERIALISING = frozenset({"unfused", "mkl-unfused", "onednn-unfused"})
FUSED_MARGIN = 1.10
# torch's convolution reorders its plain weight into oneDNN's blocked layout on every call;
# timed alone the reorder reads a weight that stays in cache. ResNet-50 batch 8 in a model
# profile: the downsample convolutions torch's call won alone by 0.1% ran 6.07 and 10.49 ms
# against 5.69 and 8.98 (the latter with an add fused) with prepacked weights. A lone
# convolution's torch call must win by the same margin.
REORDERING = frozenset({"torch"})


@dataclass(frozen=True)
class Decision:
    choice: str
    seconds: dict[str, float]  # fastest sample of each candidate that ran
    cached: bool = False

    def describe(self) -> str:
        if not self.seconds:
            return f"{self.choice} (forced by Options.implementation)"
        ranked = sorted(self.seconds.items(), key=lambda kv: kv[1])
        times = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in ranked)
        src = "cached decision" if self.cached else "measured"
        why = ""
        if self.choice != ranked[0][0] and ranked[0][0] in MATERIALISING:
            why = f"; fused kept: within {FUSED_MARGIN - 1:.0%} of the unfused call"
        elif self.choice != ranked[0][0] and ranked[0][0] in REORDERING:
            why = (
                f"; prepacked weight kept: within {FUSED_MARGIN - 1:.0%} of torch's call, "
                "which reorders its weight on every call"
            )
        return f"{self.choice} ({src}: {times}{why})"


def penalised(anchor_op: str | None, intermediate_bytes: int) -> frozenset[str]:
    """The candidates of a group whose alone-timing flatters them: materialising ones
    while their intermediate fits in the last-level cache (larger, it makes its round trip
    to memory when timed alone too: linear+bias+gelu 2048x1024x4096 writes 32 MiB and ran
    118 ms unfused against 125 ms blocked in a model, as alone, yet the margin kept the
    blocked one); torch's call on a convolution (its weight reorder)."""
    out = frozenset(MATERIALISING) if intermediate_bytes <= _cache_bytes() // 2 else frozenset()
    return out | REORDERING if anchor_op == "aten.convolution.default" else out


@functools.lru_cache(maxsize=1)
def _cache_bytes() -> int:
    """The last-level cache's size, from sysfs (32 MiB where the system does not say)."""
    best = (0, 0)  # (level, bytes)
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((d / "level").read_text())
            text = (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, (level, int(digits) * unit))
    return best[1] or 32 << 20


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


def decision_key(parts: Sequence[str]) -> str:
    h = hashlib.sha256()
    machine = (torch.__version__, platform.machine(), _cpu(), str(torch.get_num_threads()))
    for p in (*parts, *machine, TUNER_VERSION):
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _store() -> Path | None:
    try:
        from .backends.c.build import cache_dir

        return cache_dir() / "decisions.json"
    except Exception:
        return None


def load_decision(key: str) -> Decision | None:
    path = _store()
    if path is None:
        return None
    d = _read_store(path).get(key)
    return Decision(d["choice"], d["seconds"], cached=True) if d else None


def save_decision(key: str, d: Decision) -> None:
    path = _store()
    if path is None:
        return
    data = _read_store(path)  # bad entries are not written back
    data[key] = {"choice": d.choice, "seconds": d.seconds}
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # concurrent writers: last one wins, the file stays valid
    except OSError as e:  # the decision is only not remembered
        _warn_store_once(path, f"cannot be written ({e}): decisions are not remembered")


def _read_store(path: Path) -> dict[str, Any]:
    """The valid entries of the decisions file. A file that is no JSON object, and
    entries of another shape, are ignored with one warning and left out of the next save:
    a damaged file must not stop tuning (or compiling) for good."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn_store_once(path, f"is not readable JSON ({type(e).__name__}){_REDO}")
        return {}
    if not isinstance(data, dict):
        _warn_store_once(path, f"holds a {type(data).__name__}, not an object{_REDO}")
        return {}
    good = {k: v for k, v in data.items() if _valid_entry(v)}
    if len(good) != len(data):
        _warn_store_once(path, f"has {len(data) - len(good)} malformed entries{_REDO}")
    return good


def _valid_entry(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and isinstance(v.get("choice"), str)
        and isinstance(v.get("seconds"), dict)
        and all(
            isinstance(k, str) and isinstance(t, (int, float)) and not isinstance(t, bool)
            for k, t in v["seconds"].items()
        )
    )


_REDO = ": ignored, the tuner measures again and rewrites it"
_store_warned: set[str] = set()


def _warn_store_once(path: Path, what: str) -> None:
    if str(path) not in _store_warned:
        _store_warned.add(str(path))
        warnings.warn(
            f"opfuse: the decision cache {path} {what}",
            RuntimeWarning,
            stacklevel=3,
        )


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
    members = [by_name[n.name] for n in group.nodes]
    sub_group = Group(
        0, members, group.pattern, by_name[group.anchor.name] if group.anchor else None
    )
    part = Partition([sub_group])
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
