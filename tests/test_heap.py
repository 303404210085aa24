"""The heap policy: compiling hands freed memory back; keep_freed_memory keeps it."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

CHILD = """
import resource, torch, opfuse
kept = opfuse.keep_freed_memory()
def faults_per_round():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        a = torch.ones(3 << 20)   # 12 MiB, then 24 MiB: above glibc's starting mmap threshold
        b = torch.ones(6 << 20)
        del a, b
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 5
faults_per_round()
print(kept, faults_per_round())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_heap_faults_no_pages_in_on_warm_allocations() -> None:
    # in a child: the setting is process-wide
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kept, faults = out.stdout.split()
    if kept != "True":
        pytest.skip("not glibc")
    # 36 MiB written per round is 9216 pages: a heap handed back would fault them all in
    assert float(faults) < 100, faults


def _collector_states(monkeypatch: pytest.MonkeyPatch, entry: str) -> list[bool]:
    """gc.isenabled() seen by every pipeline front run while `entry` compiles a model."""
    import torch

    import opfuse
    from opfuse import pipeline

    seen: list[bool] = []
    real = pipeline._front

    def front(*a: object, **k: object) -> object:
        seen.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "_front", front)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        if entry == "compile":
            out = opfuse.compile(model, (x,))(x)
        else:
            torch._dynamo.reset()
            out = torch.compile(model, backend="opfuse")(x)
        torch.testing.assert_close(out, model(x))
    return seen


@pytest.mark.parametrize("entry", ["compile", "torch.compile"])
def test_the_collector_is_paused_while_compiling_and_restored_after(
    monkeypatch: pytest.MonkeyPatch, entry: str
) -> None:
    assert gc.isenabled()
    seen = _collector_states(monkeypatch, entry)
    assert seen and not any(seen)
    assert gc.isenabled()


def test_a_callers_paused_collector_stays_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    gc.disable()
    try:
        assert _collector_states(monkeypatch, "compile")
        assert not gc.isenabled()
    finally:
        gc.enable()
