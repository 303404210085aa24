"""The heap policy: compiling hands freed memory back; keep_freed_memory keeps it."""

from __future__ import annotations

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
