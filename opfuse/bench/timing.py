"""Interleaved timing: every repetition runs each candidate once, in turn, so that machine
drift (frequency, other load) hits all candidates alike. Reports median, min and max.

With `settle`, each timed call follows that many untimed calls of the same candidate: the
timed call then finds its own weights in the last-level cache, as in a serving loop that
runs one model back to back, instead of the previous candidate's. (Here the L3 is 480 MB and
holds a whole BERT-base: alternating candidates made every call a cold one, and the same
compiled module timed 108 ms right after inductor's and 99 ms right after itself.)

With `gap`, the machine idles that long before each candidate's calls: the engines run
their own thread pools, whose threads spin for milliseconds after a call before they
sleep, and in one process they took the CPUs from whichever candidate came next (OpenMP's
after torch's calls, ONNX Runtime's after its own). MLP batch 1 in rounds of opfuse, ONNX
Runtime, OpenVINO: 6.71 / 3.10 / 3.08 ms back to back, 2.35 / 2.42 / 2.86 with 10 ms
between; MobileNetV2 batch 1: 8.53 / 7.09 / 3.94 against 3.86 / 2.29 / 2.38 with 20 ms.
Each candidate's settling call then pays the threads' wake-up, not its timed one."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median: float
    low: float
    high: float
    reps: int
    # every timed call in round order: candidates timed in the same rounds compare call by
    # call (see `paired_ratio`)
    samples: tuple[float, ...] = ()

    def ms(self) -> str:
        return f"{self.median * 1e3:.3f}"


def time_interleaved(
    candidates: Mapping[str, Callable[[], object]],
    reps: int = 15,
    warmup: int = 3,
    min_seconds: float = 0.0,
    settle: int = 0,
    device: str = "cpu",
    gap: float = 0.0,
) -> dict[str, Timing]:
    """Time each zero-argument callable `reps` times, candidates interleaved; `settle`
    untimed calls of a candidate go before each of its timed ones, `gap` seconds of idling
    before those. On a GPU each call is timed to the end of the work it queued."""
    if device != "cpu":
        candidates = {k: _synchronised(fn, device) for k, fn in candidates.items()}
    with torch.no_grad():
        for fn in candidates.values():
            for _ in range(warmup):
                fn()
        samples: dict[str, list[float]] = {k: [] for k in candidates}
        start = time.perf_counter()
        r = 0
        while r < reps or time.perf_counter() - start < min_seconds:
            for k, fn in candidates.items():
                if gap:
                    time.sleep(gap)
                for _ in range(settle):
                    fn()
                t0 = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t0)
            r += 1
    return {k: of(v) for k, v in samples.items()}


def of(samples: list[float]) -> Timing:
    """The summary of a candidate's timed calls."""
    return Timing(
        statistics.median(samples), min(samples), max(samples), len(samples), tuple(samples)
    )


def paired_ratio(a: Timing, b: Timing) -> float:
    """Median over rounds of a's call time over b's, for two candidates timed in the same
    rounds; the ratio of medians where they were not. Drift from one round to the next
    (frequency, a neighbour's load) hits both calls of a round alike and cancels in the
    ratio, which the ratio of the two medians does not do."""
    if len(a.samples) != len(b.samples) or not a.samples:
        return a.median / b.median
    return statistics.median(x / y for x, y in zip(a.samples, b.samples))


def _synchronised(fn: Callable[[], object], device: str) -> Callable[[], object]:
    def call() -> object:
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return call
