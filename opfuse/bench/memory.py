"""Peak memory: each candidate runs in a fresh subprocess; the number is the process's
resident high-water mark (VmHWM) at the end, minus its resident size right after importing
torch and opfuse. It covers weights, compilation and the run itself, as a deployment sees.

    python -m opfuse.bench.memory CASE CANDIDATE   ->  prints {"peak_bytes": ...}
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from typing import Any

import torch
import torch.nn as nn

from .models import GPT2Block, realistic


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


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


CASES = {
    "pre-norm Transformer block inference (8x512x768)": _prenorm_block,
    "BatchNorm training step (32x64x56x56, conv-bn-relu x2)": _bn_train_step,
}
CANDIDATES = ("eager", "inductor", "opfuse")


def child(case: str, candidate: str) -> dict[str, int]:
    import opfuse

    base = _status()["VmRSS"]
    model, inputs, training = CASES[case]()
    if training:
        fwd: Any = {
            "eager": model,
            "inductor": torch.compile(model),
            "opfuse": torch.compile(model, backend="opfuse"),
        }[candidate]
        for _ in range(2):
            fwd(*inputs).sum().backward()
            model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            if candidate == "eager":
                fwd = model
            elif candidate == "inductor":
                fwd = torch.compile(model)
            else:
                fwd = opfuse.compile(model, inputs)
            for _ in range(2):
                out = fwd(*inputs)
                del out
    gc.collect()
    s = _status()
    return {"peak_bytes": s["VmHWM"] - base, "base_bytes": base}


def measure(case: str) -> dict[str, int]:
    """Peak bytes per candidate, each in a fresh process with empty compile caches."""
    import tempfile

    out = {}
    for cand in CANDIDATES:
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
        out[cand] = json.loads(res.stdout.strip().splitlines()[-1])["peak_bytes"]
    return out


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(json.dumps(child(sys.argv[1], sys.argv[2])))
