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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .cases import Case, all_cases
from .memory import PRECISION_ENV
from .tables import Result, markdown, plots, print_table
from .timing import of, time_interleaved

# Seconds of idling before each candidate's calls in a model row (timing.py)
GAP = 0.02


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


def run_inference(
    case: Case, reps: int, inductor: bool = True, device: str = "cpu", engines: bool = True
) -> Result:
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
    if engines and device == "cpu" and case.group == "model":
        from .engines import prepare

        others, res.left_out = prepare(model, inputs, expected)
        candidates.update(others)
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
    # Whole models also idle GAP between candidates: the engines' thread pools stop
    # spinning (timing.py); the micro cases all run on OpenMP's one pool.
    whole = case.group == "model"
    res.timings = time_interleaved(
        candidates,
        reps=reps,
        warmup=1 if whole else 3,
        settle=1 if whole else 0,
        device=device,
        gap=GAP if whole else 0.0,
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
    engines: bool = True,
    dynamic: bool = True,
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
    jobs: list[tuple[str, str, Callable[[], Result | list[Result]]]] = [
        (
            c.name,
            c.group,
            functools.partial(
                run_inference,
                c,
                5 if quick else min(reps, c.reps),
                device=device,
                engines=engines,
            ),
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
    if dynamic and not quick and device == "cpu":
        from . import dynamic as dyn

        jobs += [
            ("gpt2_small generate 64 tokens", "dynamic", functools.partial(dyn.run_generate, 5)),
            ("bert_base over 8 lengths", "dynamic", functools.partial(dyn.run_lengths, 5)),
            ("mobilenet_v2 over 6 batch sizes", "dynamic", functools.partial(dyn.run_batches, 5)),
            (
                "resnet50 over 6 batch sizes",
                "dynamic",
                functools.partial(dyn.run_batches, 5, name="resnet50"),
            ),
            ("mobilenet_v2 over 5 image sizes", "dynamic", functools.partial(dyn.run_images, 5)),
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
        done = _guarded(name, group, job)
        for r in done if isinstance(done, list) else [done]:
            r.wall_seconds = time.perf_counter() - t0
            results.append(r)
        if d is not None:  # partial results survive an interrupted run
            _write(d, results, time.perf_counter() - t_start, final=False, device=device)
    elapsed = time.perf_counter() - t_start
    text = markdown(results, _title(elapsed, device))
    print_table(text)
    if d is not None:
        _write(d, results, elapsed, final=True, device=device)
    return 1 if any(r.error for r in results) else 0


def _guarded(
    name: str, group: str, job: Callable[[], Result | list[Result]]
) -> Result | list[Result]:
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
