"""Peak memory of running a model, each candidate in a fresh subprocess.

Two numbers per candidate:
- working: the resident high-water mark while one inference call (or one training step)
  runs, above what the process held just before it, plus what the candidate keeps between
  calls (opfuse's pooled intermediates and recycled outputs), i.e. the memory the run
  itself needs. Compilation is done before the measured run.
- process: the process's high-water mark over its whole life, above its size after
  importing torch: weights, compilation and the run, as a deployment sees it.

The same children also give the truly cold compile time: a new process, empty caches,
nothing of torch's tracing machinery imported or warmed yet (training: the first step).

    python -m opfuse.bench.memory CASE CANDIDATE
        ->  prints {"working": bytes, "process": bytes, "compile": seconds}
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .models import GPT2Block, build, realistic


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: the high-water mark restarts from the current size


def _prenorm_block() -> tuple[nn.Module, tuple[Any, ...], bool]:
    torch.manual_seed(0)
    return GPT2Block().eval(), (torch.randn(8, 512, 768),), False


def _bn_train_step() -> tuple[nn.Module, tuple[Any, ...], bool]:
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(64, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
    )
    return realistic(m).train(), (torch.randn(32, 64, 56, 56),), True


def _model(name: str, batch: int) -> Callable[[], tuple[nn.Module, tuple[Any, ...], bool]]:
    def make() -> tuple[nn.Module, tuple[Any, ...], bool]:
        model, inputs = build(name, batch)
        return model.eval(), inputs, False

    return make


CASES = {
    "pre-norm Transformer block inference (8x512x768)": _prenorm_block,
    "BatchNorm training step (32x64x56x56, conv-bn-relu x2)": _bn_train_step,
    "resnet50 batch 8 inference": _model("resnet50", 8),
    "bert_base batch 8 inference": _model("bert_base", 8),
}
TRAINING = frozenset({"BatchNorm training step (32x64x56x56, conv-bn-relu x2)"})
CANDIDATES = ("eager", "inductor", "inductor-freezing", "opfuse")
PRECISION_ENV = "OPFUSE_BENCH_MATMUL_PRECISION"  # the parent's float32 matmul precision


def child(case: str, candidate: str) -> dict[str, float]:
    import time

    import opfuse
    from opfuse.runtime.execute import persistent_bytes

    torch.set_float32_matmul_precision(os.environ.get(PRECISION_ENV, "highest"))
    start = _status()["VmRSS"]
    model, inputs, training = CASES[case]()
    t0 = time.perf_counter()
    if training:
        fwd: Any = {
            "eager": lambda: model,
            "inductor": lambda: torch.compile(model),
            "opfuse": lambda: torch.compile(model, backend="opfuse"),
        }[candidate]()

        def run() -> None:
            fwd(*inputs).sum().backward()
            model.zero_grad(set_to_none=True)

        if candidate != "eager":
            run()  # compiles forward and backward
    else:
        with torch.no_grad():
            if candidate == "opfuse":
                fwd = opfuse.compile(model, inputs)
            elif candidate.startswith("inductor"):
                # with freezing inductor prepacks weights too: the like-for-like comparison
                torch._inductor.config.freezing = candidate == "inductor-freezing"
                fwd = torch.compile(model)
                fwd(*inputs)  # compiles
            else:
                fwd = model

        def run() -> None:
            with torch.no_grad():
                out = fwd(*inputs)
                del out

    compiled = time.perf_counter() - t0
    gc.collect()
    compile_peak = _status()["VmHWM"]
    kept_before = persistent_bytes()
    _reset_peak()
    base = _status()["VmRSS"]
    run()
    gc.collect()
    s = _status()
    # A pool allocated before the measured run (training: by the compiling step) is
    # memory the run needs too.
    working = s["VmHWM"] - base + kept_before
    return {
        "working": working,
        "process": max(compile_peak, s["VmHWM"]) - start,
        "compile": compiled if candidate != "eager" else 0.0,
    }


def measure(case: str) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
    """({"working" | "process": {candidate: bytes}}, {candidate: compile seconds}), each
    candidate in a fresh process with empty compile caches."""
    import tempfile

    out: dict[str, dict[str, int]] = {"working": {}, "process": {}}
    compile_s: dict[str, float] = {}
    training = case in TRAINING
    for cand in CANDIDATES:
        if training and cand == "inductor-freezing":
            continue  # freezing is for inference
        with tempfile.TemporaryDirectory() as d:
            env = dict(
                os.environ,
                OPFUSE_CACHE_DIR=os.path.join(d, "o"),
                TORCHINDUCTOR_CACHE_DIR=os.path.join(d, "i"),
            )
            res = subprocess.run(
                [sys.executable, "-m", "opfuse.bench.memory", case, cand],
                capture_output=True,
                text=True,
                env=env,
                timeout=900,
            )
        if res.returncode != 0:
            raise RuntimeError(f"memory run {case}/{cand} failed: {res.stderr[-2000:]}")
        got = json.loads(res.stdout.strip().splitlines()[-1])
        for k in out:
            out[k][cand] = got[k]
        if cand != "eager":
            compile_s[cand] = got["compile"]
    return out, compile_s


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(json.dumps(child(sys.argv[1], sys.argv[2])))
