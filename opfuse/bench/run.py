"""`opfuse bench`: run the cases, check correctness, time candidates side by side, print
and save the results (terminal table, markdown, JSON)."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .cases import Case, all_cases
from .timing import Timing, time_interleaved


@dataclass
class Result:
    case: str
    group: str
    timings: dict[str, Timing] = field(default_factory=dict)
    compile_seconds: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    copy: Timing | None = None
    kernels_before: int = 0
    kernels_after: int = 0
    error: str = ""

    def speedup(self, base: str) -> float | None:
        if "opfuse" not in self.timings or base not in self.timings:
            return None
        return self.timings[base].median / self.timings["opfuse"].median

    def bandwidth_pct(self) -> float | None:
        if not self.bytes or self.copy is None or "opfuse" not in self.timings:
            return None
        ours = self.bytes / self.timings["opfuse"].median
        copy = 2 * (self.bytes // 2) / self.copy.median
        return 100.0 * ours / copy


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def run_case(case: Case, reps: int, inductor: bool = True) -> Result:
    import opfuse

    res = Result(case.name, case.group)
    model, inputs = case.build()
    with torch.no_grad():
        expected = model(*inputs)
    t0 = time.perf_counter()
    fast = opfuse.compile(model, inputs)
    res.compile_seconds["opfuse"] = time.perf_counter() - t0
    report = getattr(fast, "report", None)
    if report is not None:
        res.kernels_before, res.kernels_after = report.kernels_before, report.kernels_after
    with torch.no_grad():
        got = fast(*inputs)
    problem = _mismatch(got, expected)
    if problem:
        res.error = f"opfuse output differs from eager: {problem}"
        return res
    candidates: dict[str, Any] = {"eager": lambda: model(*inputs), "opfuse": lambda: fast(*inputs)}
    if inductor:
        torch._dynamo.reset()
        ind = torch.compile(model)
        t0 = time.perf_counter()
        with torch.no_grad():
            ind(*inputs)
        res.compile_seconds["inductor"] = time.perf_counter() - t0
        candidates["inductor"] = lambda: ind(*inputs)
    if case.min_bytes is not None:
        res.bytes = case.min_bytes(inputs, expected)
        src = torch.empty(res.bytes // 2, dtype=torch.uint8)
        dst = torch.empty_like(src)
        candidates["copy"] = lambda: dst.copy_(src)
    timings = time_interleaved(candidates, reps=reps)
    res.copy = timings.pop("copy", None)
    res.timings = timings
    return res


def _mismatch(got: Any, expected: Any) -> str:
    from ..structure import flatten

    a, _ = flatten(got)
    b, _ = flatten(expected)
    if len(a) != len(b):
        return f"{len(a)} outputs, expected {len(b)}"
    for x, y in zip(a, b):
        try:
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-4, equal_nan=True)
        except AssertionError as e:
            return str(e).splitlines()[0]
    return ""


def markdown(results: list[Result], title: str) -> str:
    lines = [
        f"### {title}",
        "",
        "| case | eager ms | inductor ms | opfuse ms | vs eager | vs inductor | GB/s "
        "| % of copy | kernels |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.case} | | | | | | | | **{r.error}** |")
            continue
        t = r.timings
        bw = f"{r.bytes / t['opfuse'].median / 1e9:.1f}" if r.bytes else ""
        pct = r.bandwidth_pct()
        lines.append(
            f"| {r.case} | {t['eager'].ms()} | {t['inductor'].ms() if 'inductor' in t else ''} | "
            f"{t['opfuse'].ms()} | {_x(r.speedup('eager'))} | {_x(r.speedup('inductor'))} | {bw} | "
            f"{f'{pct:.0f}%' if pct is not None else ''} | {r.kernels_before} → {r.kernels_after} |"
        )
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else ""


def main(
    quick: bool = False, reps: int = 15, out: str | None = None, only: str | None = None
) -> int:
    cases: list[Case] = [c for c in all_cases() if (c.quick or not quick)]
    if only:
        cases = [c for c in cases if only in c.name or only == c.group]
    results = []
    for c in cases:
        print(f"... {c.name}", flush=True)
        results.append(run_case(c, reps=reps if not quick else max(5, reps // 3)))
    title = f"opfuse bench ({machine()})"
    text = markdown(results, title)
    print(text)
    if out:
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "results.md").write_text(text + "\n")
        (d / "results.json").write_text(
            json.dumps({"machine": machine(), "results": [asdict(r) for r in results]}, indent=1)
        )
    return 1 if any(r.error for r in results) else 0
