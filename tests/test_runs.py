"""Kernel steps whose arguments are all fixed run back to back from one C call
(runtime/runs.py): which steps join a run, same results as one Python call per kernel, and
a kernel's error status stops its run and raises as before."""

from __future__ import annotations

import ctypes

import pytest
import torch

import opfuse
from opfuse.backends.c import build
from opfuse.runtime import runs
from opfuse.runtime.execute import In, KernelStep, Out
from tests.conftest import assert_matches_eager


def _chain() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Softmax(-1),
        torch.nn.Linear(64, 8),
    ).eval()
    return m, torch.randn(4, 64)


# Every linear as opfuse's GEMM, a kernel: on a fresh cache the tuner may time a lone
# linear faster as a library call (a torch step, which splits the run).
KERNELS = {"implementation": "opfuse-gemm"}


def _runtime(fast: opfuse.CompiledModule):  # type: ignore[no-untyped-def]
    return fast._first.compiled.run


def test_kernels_with_fixed_arguments_run_from_one_c_call() -> None:
    m, x = _chain()
    fast = opfuse.compile(m, (x,), options=KERNELS)
    with torch.no_grad():
        first = fast(x)
        rt = _runtime(fast)
        steps = rt.plan.steps
        assert all(type(s) is KernelStep for s in steps), [s.name for s in steps]
        # the first kernel reads the caller's input and the last writes a fresh output:
        # those stay in Python; the three between (pooled results only) are one run
        fixed = [
            i
            for i, s in enumerate(steps)
            if not any(isinstance(a, In) and a.slot in rt.plan.input_slots for a in s.args)
            and not any(isinstance(a, Out) and a.block is None for a in s.args)
        ]
        assert fixed == [1, 2, 3]
        assert {r.first: r.n for r in rt._frame.runs.values()} == {1: 3}
        assert_matches_eager(m, first, (x,))
        again = fast(x + 1)
        rt._frame.runs = {}  # one Python call per kernel, as without runs
        loop = fast(x + 1)
    assert torch.equal(again, loop)


def _status_kernels() -> tuple[int, int]:
    """Addresses of two kernels: one adding 1 to the int its first argument points at, one
    returning the status 7."""
    lib = build.build(
        [
            "int count_up(void *const *args, int n) { (void)n; ++*(int *)args[0]; return 0; }\n"
            "int fail(void *const *args, int n) { (void)args; (void)n; return 7; }\n"
        ]
    )
    assert lib.handle is not None
    return runs.address(lib.fn("count_up")) or 0, runs.address(lib.fn("fail")) or 0


def test_a_failing_kernel_stops_its_run_and_raises() -> None:
    if runs._runner() is None:
        pytest.skip("no runner here (no C++ compiler)")
    count_up, fail = _status_kernels()
    counter = ctypes.c_int(0)
    arr = (ctypes.c_void_p * 1)(ctypes.addressof(counter))
    kernel = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    up, bad = kernel(count_up), kernel(fail)
    (run,) = runs.find_runs([(up, arr), (up, arr), (bad, arr), (up, arr)])
    assert (run.first, run.n) == (0, 4)
    assert run.call(2) == 7 and counter.value == 2  # the kernel after the failing one: never
    # a step that may not join splits the runs; a lone kernel is called directly
    found = runs.find_runs([(up, arr), None, (up, arr), (up, arr), None, (up, arr)])
    assert [(r.first, r.n) for r in found] == [(2, 2)]

    # in a compiled model: the run's middle kernel fails as an integer division by zero does
    m, x = _chain()
    fast = opfuse.compile(m, (x,), options=KERNELS)
    with torch.no_grad():
        fast(x)
        (model_run,) = _runtime(fast)._frame.runs.values()
        model_run.fns[1] = fail
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            fast(x)


def test_turned_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OPFUSE_NO_RUNS", "1")
    runs._runner.cache_clear()
    try:
        m, x = _chain()
        fast = opfuse.compile(m, (x,), options=KERNELS)
        with torch.no_grad():
            assert_matches_eager(m, fast(x), (x,))
        assert _runtime(fast)._frame.runs == {}
    finally:
        runs._runner.cache_clear()
