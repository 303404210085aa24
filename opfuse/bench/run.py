"""`opfuse bench`: eager vs TorchInductor (default, and with freezing) vs opfuse, side by side
in one process. Each case is checked for correctness first (a mismatch is reported, not
timed); candidates are timed interleaved; compile times are measured with empty caches (the
run uses private cache directories for opfuse and inductor) and cached (a second compile
that hits the caches), in this process; the memory rows' children also give the compile
time of a fresh process. Results: a terminal table, markdown, JSON and PNG plots."""

from __future__ import annotations

import copy
import functools
import gc
import json
import os
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .cases import Case, all_cases
from .memory import PRECISION_ENV
from .timing import Timing, of, paired_ratio, time_interleaved


@dataclass
class Result:
    case: str
    group: str
    timings: dict[str, Timing] = field(default_factory=dict)
    compile_seconds: dict[str, float] = field(default_factory=dict)  # name -> seconds
    bytes: int = 0
    copy: Timing | None = None
    bare: dict[str, Timing] = field(default_factory=dict)  # GEMM/conv without epilogue
    kernels_before: int = 0
    kernels_after: int = 0
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # working/process
    samples_per_second: dict[str, float] = field(default_factory=dict)
    # training: eager step / (its library calls + optimizer update), the most any fusion of
    # the rest can give
    ceiling: float | None = None
    error: str = ""
    wall_seconds: float = 0.0  # what the case took in all: compiles, checks, timing

    def speedup(self, base: str) -> float | None:
        """base's time over opfuse's: the median of the per-round ratios."""
        if "opfuse" not in self.timings or base not in self.timings:
            return None
        return paired_ratio(self.timings[base], self.timings["opfuse"])

    def bandwidth_pct(self) -> float | None:
        if not self.bytes or self.copy is None or "opfuse" not in self.timings:
            return None
        return 100.0 * self.copy.median / self.timings["opfuse"].median

    def epilogue_cost(self) -> float | None:
        """Fused op time over the bare library call's time, minus one: the median of the
        per-round ratios (the two run back to back in each round)."""
        if "torch" not in self.bare or "opfuse" not in self.timings:
            return None
        return paired_ratio(self.timings["opfuse"], self.bare["torch"]) - 1.0


def machine(device: str = "cpu") -> str:
    if device != "cpu":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
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


def _mismatch(got: Any, expected: Any, model: Any, inputs: tuple[Any, ...]) -> str:
    """Empty if opfuse matches eager by the oracle rule (float64 tiebreak)."""
    from ..frontend.structure import flatten

    a, _ = flatten(got)
    b, _ = flatten(expected)
    if len(a) != len(b):
        return f"{len(a)} outputs, eager has {len(b)}"
    ref64 = None
    for i, (x, y) in enumerate(zip(a, b)):
        half = y.dtype in (torch.bfloat16, torch.float16)
        try:
            torch.testing.assert_close(
                x, y, equal_nan=True, rtol=1e-2 if half else None, atol=1e-2 if half else None
            )
            continue
        except AssertionError as e:
            if not y.is_floating_point():
                return str(e).splitlines()[0]
        if ref64 is None:
            m64 = copy.deepcopy(model).double()
            with torch.no_grad():
                ref64 = flatten(m64(*[t.double() if t.is_floating_point() else t for t in inputs]))[
                    0
                ]
        err_ours = (x.double() - ref64[i]).abs().max().item()
        err_eager = (y.double() - ref64[i]).abs().max().item()
        if err_ours > 2 * err_eager + 1e-6:
            return f"output {i}: error vs float64 {err_ours:.2e}, eager's {err_eager:.2e}"
    return ""


def _inductor(
    model: Any, inputs: tuple[Any, ...], freezing: bool, reset: bool = True
) -> tuple[Any, float]:
    import torch._inductor.config as cfg

    if reset:
        torch._dynamo.reset()
    # Dynamo tells cached code apart by the backend's settings: with equal settings the
    # default candidate was served the frozen candidate's code (it ran mkl's packed
    # linear). The option keeps them apart; the global patch is what freezes (the option
    # alone leaves the weights unpacked).
    fn = torch.compile(model, options={"freezing": True} if freezing else None)
    t0 = time.perf_counter()
    with torch.no_grad(), cfg.patch(freezing=freezing):
        fn(*inputs)
    return fn, time.perf_counter() - t0


def _to(device: str, model: Any, inputs: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    if device == "cpu":
        return model, inputs
    moved = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    return model.to(device), moved


def run_inference(case: Case, reps: int, inductor: bool = True, device: str = "cpu") -> Result:
    import opfuse

    res = Result(case.name, case.group)
    model, inputs = _to(device, *case.build())
    with torch.no_grad():
        expected = model(*inputs)
    t0 = time.perf_counter()
    fast = opfuse.compile(model, inputs)
    res.compile_seconds["opfuse cold"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    opfuse.compile(model, inputs)  # kernels and timing decisions now come from the cache
    res.compile_seconds["opfuse warm"] = time.perf_counter() - t0
    report = getattr(fast, "report", None)
    if report is not None:
        res.kernels_before, res.kernels_after = report.kernels_before, report.kernels_after
    with torch.no_grad():
        got = fast(*inputs)
    res.error = _mismatch(got, expected, model, inputs)
    if res.error:
        return res
    del got
    candidates: dict[str, Any] = {"eager": lambda: model(*inputs), "opfuse": lambda: fast(*inputs)}
    if inductor:
        _, res.compile_seconds["inductor cold"] = _inductor(model, inputs, freezing=False)
        ind, res.compile_seconds["inductor warm"] = _inductor(model, inputs, freezing=False)
        candidates["inductor"] = lambda: ind(*inputs)
        ind2, res.compile_seconds["inductor-freezing cold"] = _inductor(
            model, inputs, freezing=True, reset=False
        )
        if case.group in ("model", "gemm"):
            candidates["inductor-freezing"] = lambda: ind2(*inputs)
    if case.min_bytes is not None:
        res.bytes = case.min_bytes(inputs, expected)
        # The source must hold written pages: an untouched allocation reads the kernel's
        # shared zero page, which stays in cache and made the reference copy ~1.8x too fast.
        src = torch.ones(res.bytes // 2, dtype=torch.uint8, device=device)
        dst = torch.ones_like(src)
        candidates["copy"] = lambda: dst.copy_(src)
    del expected
    if case.bare is not None:
        # The bare GEMM/conv is timed in the same interleaved rounds as the fused one: the
        # epilogue's cost is a few percent, far below this machine's drift between runs.
        bm, bi = _to(device, *case.bare())
        bfast = opfuse.compile(bm, bi)
        # right after the fused call in each round, so the two see the same moment of the
        # machine and the cost is a per-round ratio (Result.epilogue_cost)
        order = list(candidates)
        order.insert(order.index("opfuse") + 1, "bare torch")
        candidates["bare torch"] = lambda: bm(*bi)
        candidates["bare opfuse"] = lambda: bfast(*bi)
        candidates = {k: candidates[k] for k in [*order, "bare opfuse"]}
    # Whole models: each timed call right after an untimed one of the same candidate (see
    # timing.py); a micro case's working set is small next to what the rounds evict.
    # A model's settling call before each timed one also does the warm-up's work (its
    # weights back in cache); one warm-up call then pays the first call's one-time costs.
    whole = case.group == "model"
    res.timings = time_interleaved(
        candidates, reps=reps, warmup=1 if whole else 3, settle=1 if whole else 0, device=device
    )
    res.copy = res.timings.pop("copy", None)
    for k in ("torch", "opfuse"):
        t = res.timings.pop(f"bare {k}", None)
        if t is not None:
            res.bare[k] = t
    torch._dynamo.reset()
    gc.collect()
    return res


def run_training(name: str, batch: int, reps: int) -> Result:
    from .training import library_seconds, setup, step_fn

    res = Result(f"{name} batch {batch} training step", "training")
    model, inputs, loss_fn = setup(name, batch)
    steps: dict[str, Any] = {}
    losses: dict[str, float] = {}
    for how in ("eager", "inductor", "opfuse"):
        torch._dynamo.reset() if how == "inductor" else None
        step, _ = step_fn(model, inputs, loss_fn, how)
        t0 = time.perf_counter()
        losses[how] = step()  # compiles forward and backward
        res.compile_seconds[f"{how} first step"] = time.perf_counter() - t0
        steps[how] = step
    if abs(losses["opfuse"] - losses["eager"]) > 1e-3 * max(1.0, abs(losses["eager"])):
        res.error = f"first-step loss {losses['opfuse']:.6f}, eager {losses['eager']:.6f}"
        return res
    timings = {}
    with torch.enable_grad():
        # Steps mutate each candidate's own copy of the model; time them interleaved.
        samples: dict[str, list[float]] = {k: [] for k in steps}
        library: list[float] = []
        for _ in range(reps):
            for k, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t0)
            # in the same rounds, so machine drift hits it and eager's steps alike
            library.append(library_seconds(steps["eager"]))
        import statistics

        for k, v in samples.items():
            timings[k] = of(v)
    res.timings = timings
    res.samples_per_second = {k: batch / t.median for k, t in timings.items()}
    res.ceiling = timings["eager"].median / statistics.median(library)
    torch._dynamo.reset()
    return res


def run_memory(case: str) -> Result:
    from .memory import measure

    res = Result(case, "memory")
    try:
        res.memory, fresh = measure(case)
        res.compile_seconds = {f"{k} fresh process": v for k, v in fresh.items()}
    except Exception as e:  # a failed child is reported, the suite goes on
        res.error = str(e)[:300]
    return res


# -- reporting ---------------------------------------------------------------------------------
def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else ""


def _ms(t: dict[str, Timing], k: str) -> str:
    return f"{t[k].median * 1e3:.2f}" if k in t else ""


def markdown(results: list[Result], title: str) -> str:
    out = [f"### {title}", ""]
    micro = [r for r in results if r.group in ("elementwise", "reduction", "gemm")]
    if micro:
        out += [
            "| pattern | eager ms | inductor ms | opfuse ms | vs eager | vs inductor "
            "| % of copy bw | "
            "epilogue cost | kernels |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in micro:
            if r.error:
                out.append(f"| {r.case} | | | | | | | | **{r.error}** |")
                continue
            pct = r.bandwidth_pct()
            cost = r.epilogue_cost()
            out.append(
                f"| {r.case} | {_ms(r.timings, 'eager')} | {_ms(r.timings, 'inductor')} | "
                f"{_ms(r.timings, 'opfuse')} | {_x(r.speedup('eager'))} | "
                f"{_x(r.speedup('inductor'))} | {f'{pct:.0f}%' if pct is not None else ''} | "
                f"{f'{cost * 100:+.1f}%' if cost is not None else ''} | "
                f"{r.kernels_before} → {r.kernels_after} |"
            )
        out.append("")
    models = [r for r in results if r.group == "model"]
    if models:
        out += [
            "| model | eager ms | inductor ms | inductor+freezing ms | opfuse ms | vs eager | "
            "vs inductor+freezing | compile s, empty caches / cached (opfuse, inductor) "
            "| kernels |",
            "|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in models:
            if r.error:
                out.append(f"| {r.case} | | | | | | | | **{r.error}** |")
                continue
            c = r.compile_seconds
            comp = (
                f"{c.get('opfuse cold', 0):.1f} / {c.get('opfuse warm', 0):.1f}, "
                f"{c.get('inductor cold', 0):.1f} / {c.get('inductor warm', 0):.1f}"
            )
            out.append(
                f"| {r.case} | {_ms(r.timings, 'eager')} | {_ms(r.timings, 'inductor')} | "
                f"{_ms(r.timings, 'inductor-freezing')} | {_ms(r.timings, 'opfuse')} | "
                f"{_x(r.speedup('eager'))} | {_x(r.speedup('inductor-freezing'))} | {comp} | "
                f"{r.kernels_before} → {r.kernels_after} |"
            )
        out.append("")
    train = [r for r in results if r.group == "training"]
    if train:
        out += [
            "| training step | eager samples/s | inductor samples/s | opfuse samples/s "
            "| vs eager | "
            "vs inductor | ceiling vs eager |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in train:
            if r.error:
                out.append(f"| {r.case} | | | | **{r.error}** | | |")
                continue
            s = r.samples_per_second
            out.append(
                f"| {r.case} | {s.get('eager', 0):.2f} | {s.get('inductor', 0):.2f} | "
                f"{s.get('opfuse', 0):.2f} | {_x(r.speedup('eager'))} | "
                f"{_x(r.speedup('inductor'))} | {_x(r.ceiling)} |"
            )
        out += [
            "",
            "ceiling: eager's step time over the time its GEMM/convolution calls and the "
            "optimizer's update take (torch profiler), the speedup a compiler would reach "
            "if everything else cost nothing.",
        ]
        out.append("")
    mem = [r for r in results if r.group == "memory"]
    if mem:
        out += [
            "| peak memory, fresh process per candidate | measure | eager MiB | inductor MiB "
            "| inductor+freezing MiB | opfuse MiB | opfuse vs eager |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in mem:
            if r.error:
                out.append(f"| {r.case} | | | | | **{r.error}** |")
                continue
            for what, p in r.memory.items():
                drop = 1 - p["opfuse"] / p["eager"] if p.get("eager") else 0
                frozen = p.get("inductor-freezing")
                out.append(
                    f"| {r.case} | {what} | {p['eager'] / 2**20:.0f} | "
                    f"{p['inductor'] / 2**20:.0f} | "
                    f"{'' if frozen is None else f'{frozen / 2**20:.0f}'} | "
                    f"{p['opfuse'] / 2**20:.0f} | {-drop * 100:+.0f}% |"
                )
        out.append("")
        out += _fresh_compile_table(mem)
    if micro or models or train:
        out += [
            "vs columns and epilogue cost: the median over timing rounds of the two calls' "
            "ratio (each round runs every candidate once), so drift between rounds cancels; "
            "they can differ from the ratio of the ms columns (medians).",
            "",
        ]
    if micro:
        out += [
            "% of copy bw: the time torch's copy takes to read and write as many bytes as the "
            "case must, over opfuse's time: a reference, not a ceiling. Over 100% means "
            "opfuse moved its bytes faster than that copy did: its data stayed in a cache "
            "level between calls where the copy's source and destination did not, or the "
            "copy itself ran below the memory's bandwidth.",
            "",
        ]
    out += _time_spent(results)
    return "\n".join(out)


_PARTS = {"elementwise": "patterns", "reduction": "patterns", "gemm": "patterns", "model": "models"}


def _time_spent(results: list[Result]) -> list[str]:
    """Where the run's time went, per part of the suite (the whole run has a budget)."""
    spent: dict[str, float] = {}
    for r in results:
        part = _PARTS.get(r.group, r.group)
        spent[part] = spent.get(part, 0.0) + r.wall_seconds
    if not any(spent.values()):
        return []
    parts = ", ".join(f"{k} {v / 60:.1f} min" for k, v in spent.items())
    return [f"time spent: {parts}", ""]


def _fresh_compile_table(mem: list[Result]) -> list[str]:
    rows = [r for r in mem if not r.error and r.compile_seconds]
    if not rows:
        return []
    out = [
        "| cold compile: fresh process, empty caches (training: first step) | inductor s "
        "| inductor+freezing s | opfuse s | opfuse / inductor |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = {k.removesuffix(" fresh process"): v for k, v in r.compile_seconds.items()}
        frozen = c.get("inductor-freezing")
        ratio = c["opfuse"] / c["inductor"] if c.get("inductor") else None
        out.append(
            f"| {r.case} | {c.get('inductor', 0):.1f} | "
            f"{'' if frozen is None else f'{frozen:.1f}'} | {c.get('opfuse', 0):.1f} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} |"
        )
    out.append("")
    return out


def print_table(text: str) -> None:
    """Rich tables on a terminal; the markdown itself when piped (logs, CI)."""
    import sys

    if not sys.stdout.isatty():
        print(text)
        return
    try:
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(text))
    except ImportError:
        print(text)


def plots(results: list[Result], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    models = [r for r in results if r.group == "model" and not r.error]
    if models:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        names = [r.case for r in models]
        xs = range(len(models))
        for i, (cand, color) in enumerate(
            [("inductor", "#999999"), ("inductor-freezing", "#555555"), ("opfuse", "#d95f02")]
        ):
            vals = [
                paired_ratio(r.timings["eager"], r.timings[cand]) if cand in r.timings else 0
                for r in models
            ]
            ax.bar([x + (i - 1) * 0.27 for x in xs], vals, width=0.27, label=cand, color=color)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speedup over eager")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=120)
        plt.close(fig)
        made.append("speedup.png")
    micro = [r for r in results if r.bandwidth_pct() is not None and not r.error]
    if micro:
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.barh([r.case for r in micro], [r.bandwidth_pct() or 0 for r in micro], color="#1b9e77")
        ax.axvline(80, color="black", linestyle="--", linewidth=0.8)
        ax.set_xlabel("effective bandwidth, % of copy at the same size")
        fig.tight_layout()
        fig.savefig(out / "bandwidth.png", dpi=120)
        plt.close(fig)
        made.append("bandwidth.png")
    return made


def main(
    quick: bool = False,
    reps: int = 15,
    out: str | None = None,
    only: str | None = None,
    training: bool = True,
    memory: bool = True,
    matmul_precision: str = "highest",
    device: str = "cpu",
    keep_heap: bool = False,
) -> int:
    if keep_heap:
        from ..runtime.heap import MMAP_THRESHOLD, TRIM_THRESHOLD, keep_freed_memory

        keep_freed_memory()
        # the memory rows' children too
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(TRIM_THRESHOLD)
    # Every candidate runs under the same float32 matmul precision; below "highest" opfuse
    # may pick oneDNN's faster, less exact float32 GEMM (see lower/groups.py). The memory
    # rows' child processes inherit it through the environment.
    torch.set_float32_matmul_precision(matmul_precision)
    os.environ[PRECISION_ENV] = matmul_precision
    # Private caches: compile times are cold for both compilers, and the user's caches
    # are left alone.
    scratch = tempfile.mkdtemp(prefix="opfuse-bench-")
    os.environ["OPFUSE_CACHE_DIR"] = os.path.join(scratch, "opfuse")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(scratch, "inductor")
    cases = [c for c in all_cases() if c.quick or not quick]
    jobs: list[tuple[str, str, Callable[[], Result]]] = [
        (
            c.name,
            c.group,
            functools.partial(run_inference, c, 5 if quick else min(reps, c.reps), device=device),
        )
        for c in cases
    ]
    if device != "cpu":
        # The training and memory rows measure this process's CPU work and RSS.
        training = memory = False
    if training and not quick:
        from .training import CASES

        jobs += [
            (f"{n} batch {b} training step", "training", functools.partial(run_training, n, b, 5))
            for n, b in CASES
        ]
    if memory and not quick:
        from .memory import CASES as MEM

        jobs += [(f"memory: {m}", "memory", functools.partial(run_memory, m)) for m in MEM]
    if only:
        jobs = [j for j in jobs if only in j[0] or only == j[1]]
    results: list[Result] = []
    t_start = time.perf_counter()
    d = Path(out) if out else None
    for name, group, job in jobs:
        print(f"... {name}", flush=True)
        t0 = time.perf_counter()
        results.append(_guarded(name, group, job))
        results[-1].wall_seconds = time.perf_counter() - t0
        if d is not None:  # partial results survive an interrupted run
            _write(d, results, time.perf_counter() - t_start, final=False, device=device)
    elapsed = time.perf_counter() - t_start
    text = markdown(results, _title(elapsed, device))
    print_table(text)
    if d is not None:
        _write(d, results, elapsed, final=True, device=device)
    return 1 if any(r.error for r in results) else 0


def _guarded(name: str, group: str, job: Callable[[], Result]) -> Result:
    """One case's failure is a row of the table, not the end of the run."""
    try:
        return job()
    except Exception as e:
        traceback.print_exc()
        return Result(name, group, error=f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        torch._dynamo.reset()
        gc.collect()


def _title(elapsed: float, device: str = "cpu") -> str:
    precision = torch.get_float32_matmul_precision()
    extra = f"; float32 matmul precision {precision!r}" if precision != "highest" else ""
    if os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        extra += "; freed heap kept (MALLOC_TRIM_THRESHOLD_, as --keep-heap sets it)"
    return f"opfuse bench ({machine(device)}; {elapsed / 60:.1f} min{extra})"


def _write(
    d: Path, results: list[Result], elapsed: float, final: bool, device: str = "cpu"
) -> None:
    d.mkdir(parents=True, exist_ok=True)
    text = markdown(results, _title(elapsed, device))
    made = plots(results, d) if final else []
    extra = "".join(f"\n![{m}]({m})" for m in made)
    (d / "results.md").write_text(text + extra + "\n")
    (d / "results.json").write_text(
        json.dumps(
            {
                "machine": machine(device),
                "complete": final,
                "results": [asdict(r) for r in results],
            },
            indent=1,
        )
    )
