"""The heap policy: compiling hands freed memory back; keep_freed_memory keeps it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from opfuse.runtime.heap import HUGE_PAGE, weight_buffer

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


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="Linux's transparent huge pages",
)
def test_a_large_packed_weight_is_asked_onto_huge_pages() -> None:
    """A packed weight of megabytes starts on a huge page boundary and its mapping carries
    the huge page advice ("hg"); a small one is a plain tensor."""
    big = weight_buffer(3 << 20)  # 12 MiB of floats
    assert big.numel() == 3 << 20 and big.dtype == torch.float32
    assert big.data_ptr() % HUGE_PAGE == 0
    assert "hg" in _vm_flags(big.data_ptr() + HUGE_PAGE)
    big.fill_(1.5)  # the whole span is ours to write
    assert big.sum().item() == 1.5 * (3 << 20)
    small = weight_buffer(1000)
    assert small.numel() == 1000 and small.storage_offset() == 0


def test_a_packed_linear_weight_comes_from_weight_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """opfuse's GEMM packs a frozen weight into a weight_buffer (huge pages: a weight that
    streams from memory at a small batch, MLP b8 on a Zen 2 9.3-9.7 -> 7.1-7.3 ms)."""
    import opfuse
    import opfuse.backends.c.gemm as gemm

    asked: list[int] = []

    def spy(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        asked.append(numel)
        return weight_buffer(numel, dtype)

    monkeypatch.setattr(gemm, "weight_buffer", spy)
    lin = torch.nn.Linear(1024, 1024).eval()
    x = torch.randn(4, 1024)
    fast = opfuse.compile(lin, (x,), options=opfuse.Options(implementation="opfuse-gemm"))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), lin(x), rtol=1e-5, atol=1e-5)
    assert any(n >= 1024 * 1024 for n in asked), asked
