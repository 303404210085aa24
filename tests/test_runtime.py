"""Runtime faults and guarantees: missing compiler, corrupt and unsafe caches, concurrent
builds, recompiling on new shapes, memory reuse, fresh outputs, debug dumps."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import opfuse
from opfuse import pipeline
from opfuse.backends import base
from opfuse.backends.c import build
from tests.conftest import Fn, assert_matches_eager

ROOT = Path(__file__).resolve().parent.parent


def model() -> torch.nn.Module:
    return Fn(lambda x, y: torch.tanh(x * y + 1).relu() * 3 - y).eval()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(50, 40, generator=g), torch.randn(40, generator=g)


@pytest.mark.parametrize("setting", ["missing", "none_on_path"])
def test_no_compiler_falls_back_to_torch(monkeypatch, fresh_cache, setting) -> None:  # type: ignore[no-untyped-def]
    if setting == "missing":
        monkeypatch.setenv("CC", "/nonexistent/cc")
    else:
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", "")
    m, args = model(), inputs()
    with pytest.warns(RuntimeWarning, match="could not be built"):
        fast = opfuse.compile(m, args)
    assert [g.pattern for g in fast.report.groups] == ["fallback"]
    assert_matches_eager(m, fast(*args), args)


def test_compiler_error_falls_back(monkeypatch, fresh_cache, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fake = tmp_path / "badcc"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo badcc 1.0; exit 0; fi\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    m, args = model(), inputs()
    with pytest.warns(RuntimeWarning):
        fast = opfuse.compile(m, args)
    assert_matches_eager(m, fast(*args), args)


def _run_child(code: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


CHILD = """
    import warnings, torch, opfuse
    warnings.simplefilter("ignore", FutureWarning)
    from tests.test_runtime import model, inputs
    m, args = model(), inputs()
    fast = opfuse.compile(m, args)
    torch.testing.assert_close(fast(*args), m(*args))
    print("cached" if fast.report.cached else "built", fast.report.groups[0].pattern)
"""


def test_warm_cache_hit_and_corrupt_entry_rebuilt(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = dict(os.environ, OPFUSE_CACHE_DIR=str(tmp_path / "c"))
    assert _run_child(CHILD, env).split() == ["built", "elementwise"]
    assert _run_child(CHILD, env).split() == ["cached", "elementwise"]
    # (ext-*.so: the arena's allocator, built once, runtime/arena.py)
    libs = [p for p in (tmp_path / "c").glob("*.so") if not p.name.startswith("ext-")]
    assert len(libs) == 1
    data = libs[0].read_bytes()
    libs[0].write_bytes(data[: len(data) // 3])  # truncated
    assert _run_child(CHILD, env).split() == ["built", "elementwise"]
    libs[0].write_bytes(b"\x7fELF garbage" + data[20:])  # corrupt, same size
    assert _run_child(CHILD, env).split() == ["built", "elementwise"]


def test_concurrent_builds_of_the_same_kernels(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = dict(os.environ, OPFUSE_CACHE_DIR=str(tmp_path / "c"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(CHILD)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert out.split()[1] == "elementwise"
    libs = [p.name for p in (tmp_path / "c").glob("*.so")]
    # the C++ helpers where they build: the arena's allocator, the runner of kernel runs,
    # the parameter watch's sum of version counters
    ext = [n for n in libs if n.startswith("ext-")]
    assert len(libs) - len(ext) == 1 and len(ext) <= 3
    assert not list((tmp_path / "c").glob("tmp*"))  # no temporary files left behind


def test_cache_directory_writable_by_others_is_refused(fresh_cache) -> None:  # type: ignore[no-untyped-def]
    fresh_cache.mkdir(parents=True)
    fresh_cache.chmod(0o777)
    with pytest.raises(base.UnsafeCacheError):
        base.cache_dir()
    m, args = model(), inputs()
    with pytest.warns(RuntimeWarning, match="other users"):
        fast = opfuse.compile(m, args)
    assert fast.report.groups[0].pattern == "fallback"
    assert_matches_eager(m, fast(*args), args)


def test_cached_library_writable_by_others_is_refused(fresh_cache) -> None:  # type: ignore[no-untyped-def]
    m, args = model(), inputs()
    opfuse.compile(m, args)
    (lib,) = fresh_cache.glob("*.so")
    lib.chmod(lib.stat().st_mode | stat.S_IWOTH)
    pipeline._warned.clear()
    with pytest.warns(RuntimeWarning, match="other users"):
        fast = opfuse.compile(m, args)
    assert fast.report.groups[0].pattern == "fallback"
    assert_matches_eager(m, fast(*args), args)


def test_cache_directory_is_private(fresh_cache) -> None:  # type: ignore[no-untyped-def]
    d = base.cache_dir()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_new_shape_recompiles() -> None:
    m, (x, y) = model(), inputs()
    fast = opfuse.compile(m, (x, y))
    x2, y2 = torch.randn(7, 3, 40), torch.randn(40)
    assert_matches_eager(m, fast(x2, y2), (x2, y2))
    xt = torch.randn(40, 50).t()  # same shape, other strides
    assert_matches_eager(m, fast(xt, y), (xt, y))
    assert_matches_eager(m, fast(x.double(), y.double()), (x.double(), y.double()))
    assert len(fast._entries) == 4


def test_recompile_off_names_the_mismatch() -> None:
    m, (x, y) = model(), inputs()
    fast = opfuse.compile(m, (x, y), recompile=False)
    with pytest.raises(
        opfuse.RecompileError, match=r"input 0 has shape \[10, 40\], compiled for \[50, 40\]"
    ):
        fast(torch.randn(10, 40), y)
    with pytest.raises(opfuse.RecompileError, match="dtype"):
        fast(x.double(), y)
    torch.testing.assert_close(fast(x, y), m(x, y))


def test_intermediates_reuse_memory_across_calls() -> None:
    def f(x):  # type: ignore[no-untyped-def]
        a = (x * 2).relu()  # kernel 1 -> intermediate
        b = torch.cumsum(a, 1)  # torch op between kernels
        return (b + a).sigmoid()  # kernel 2 reads both

    m = Fn(f).eval()
    x = torch.randn(64, 64)
    fast = opfuse.compile(m, (x,))
    run = fast._first.compiled.run
    assert run.plan.pool_sizes, "the intermediate of kernel 1 should be pooled"
    out1 = fast(x)
    blocks = [b.data_ptr() for b in run._frame.blocks]
    out2 = fast(x)
    assert [b.data_ptr() for b in run._frame.blocks] == blocks
    assert out1.data_ptr() != out2.data_ptr()  # out1 is still held: out2 is fresh
    torch.testing.assert_close(out1, out2)
    assert_matches_eager(m, out2, (x,))


@pytest.mark.parametrize("returns_hidden", [False, True])
def test_unfused_gemm_writes_into_the_pool_through_out(returns_hidden: bool) -> None:
    # An MLP whose GEMMs torch runs: the hidden layer goes into a pooled block through
    # addmm's out= overload and the gelu kernel writes over it (through the 3-D view);
    # a GEMM result the caller gets back is never pooled.
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(32, 96), torch.nn.Linear(96, 32)

    def f(x):  # type: ignore[no-untyped-def]
        h = fc1(x)
        y = fc2(torch.nn.functional.gelu(h)) + x
        return (y, h) if returns_hidden else y

    m = Fn(f).eval()
    x = torch.randn(4, 25, 32)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="unfused"))
    plan = fast._first.compiled.run.plan
    pooled = {s.name: s.out_block for s in plan.steps if getattr(s, "out_block", None) is not None}
    gelu = next(s for s in plan.steps if s.name.startswith("fused_gelu"))
    assert "addmm_1" in pooled  # fc2's result, read by the residual add's kernel
    if returns_hidden:
        assert "addmm" not in pooled, pooled
    else:
        (out,) = [a for a in gelu.args if type(a).__name__ == "Out"]
        assert out.block == pooled["addmm"]  # in place, in the pool
    for _ in range(2):  # the pooled block is reused by the second call
        with torch.no_grad():
            got = fast(x)
        assert_matches_eager(m, got, (x,))


def _attention_like(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # linear -> view -> permute -> bmm: the views read a pooled GEMM result.
    b, s, d = q.shape
    h = torch.nn.functional.linear(q, k)
    h = h.view(b, s, 4, d // 4).permute(0, 2, 1, 3).reshape(b * 4, s, d // 4)
    scores = torch.bmm(h, h.transpose(1, 2)).softmax(-1)
    return torch.bmm(scores, h).view(b, 4, s, d // 4).sum(1)


def test_views_of_fixed_memory_are_made_once() -> None:
    # A view whose base is a pooled block or a constant has the same address on every call:
    # the runtime computes it at the first call and never runs its step again.
    torch.manual_seed(0)
    w = torch.randn(32, 32)
    m = Fn(lambda q: _attention_like(q, w)).eval()
    x = torch.randn(2, 24, 32)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="unfused"))
    rt = fast._first.compiled.run
    calls: list[str] = []
    for step in rt.plan.steps:
        if getattr(step, "view", False):
            fn = step.fn
            step.fn = lambda *a, _fn=fn, _n=step.name, **k: (calls.append(_n), _fn(*a, **k))[1]
    views = [s.name for s in rt.plan.steps if getattr(s, "view", False)]
    assert views, [s.name for s in rt.plan.steps]
    with torch.no_grad():
        assert_matches_eager(m, fast(x), (x,))
        first = list(calls)
        calls.clear()
        got = fast(x + 1)
    assert_matches_eager(m, got, (x + 1,))
    assert sorted(first) == sorted(views)  # each view made once by the first call
    skipped = {s.name for s, skip in zip(rt.plan.steps, rt._frame.skip) if skip}
    assert skipped and not skipped & set(calls), (skipped, calls)


def test_first_call_under_inference_mode_then_outside() -> None:
    # Pooled blocks (written through out= by torch) made under inference_mode would be
    # inference tensors that torch refuses to write outside it.
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(32, 96), torch.nn.Linear(96, 32)
    m = Fn(lambda x: fc2(torch.nn.functional.gelu(fc1(x))) + x).eval()
    x = torch.randn(4, 25, 32)
    fast = opfuse.compile(m, (x,), options=opfuse.Options(implementation="unfused"))
    with torch.inference_mode():
        a = fast(x)
    assert a.is_inference()
    with torch.no_grad():
        b = fast(x)
    assert not b.is_inference()  # not the recycled inference tensor
    assert torch.equal(a, b)
    assert_matches_eager(m, b, (x,))


def test_dropped_outputs_are_recycled_held_ones_never() -> None:
    m, args = model(), inputs()
    fast = opfuse.compile(m, args)
    a = fast(*args)
    view = a[3:]
    ptr = a.data_ptr()
    del a
    b = fast(*args)
    assert b.data_ptr() != ptr  # a view of the old output is alive
    del view
    c_ptr = b.data_ptr()
    del b
    c = fast(*args)
    assert c.data_ptr() == c_ptr  # nothing refers to it any more: reused
    torch.testing.assert_close(c, m(*args))


class _FromWeights(torch.nn.Module):
    """Outputs computed from the weights alone (folded at compile time), one returned twice,
    and the weight itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scaled = self.lin.weight * 2
        return scaled, scaled, self.lin(x), self.lin.weight


def test_an_output_folded_from_weights_is_fresh_at_every_call() -> None:
    # it was the folded constant itself: a caller adding to one call's output changed
    # what every later call returned
    m = _FromWeights().eval()
    x = torch.randn(3, 4)
    fast = opfuse.compile(m, (x,))
    with torch.no_grad():
        first = fast(x)
        first[0].add_(100.0)
        again = fast(x)
        want = m(x)
    for out, ref in zip(again, want):
        torch.testing.assert_close(out, ref)
    assert again[0] is again[1]  # one tensor returned twice, as eager returns it
    assert again[3].data_ptr() == m.lin.weight.data_ptr()  # the weight, as eager's


def test_single_thread_and_thread_count_changes() -> None:
    m = Fn(lambda x: (x * 2).exp().sum(-1)).eval()
    x = torch.randn(256, 1024)
    fast = opfuse.compile(m, (x,))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert_matches_eager(m, fast(x), (x,))
    finally:
        torch.set_num_threads(n)
    assert_matches_eager(m, fast(x), (x,))


def test_debug_dir_gets_source_and_table(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OPFUSE_DEBUG_DIR", str(tmp_path / "dbg"))
    m, args = model(), inputs()
    opfuse.compile(m, args)
    (run,) = (tmp_path / "dbg").iterdir()  # one folder per compiled graph
    files = sorted(p.suffix for p in run.iterdir() if not p.name[0].isdigit())
    assert files == [".c", ".json", ".txt"]
    src = (run / "source.c").read_text()
    assert "fused_mul_add_tanh_relu" in src and "#pragma omp" in src


def _dead_reads(plan) -> list[str]:  # type: ignore[no-untyped-def]
    """Slots a step reads after an earlier step declared them dead."""
    from opfuse.runtime.execute import In, KernelStep, Slot, TorchStep

    dead: set[int] = set()
    bad = []

    def slots(v):  # type: ignore[no-untyped-def]
        if isinstance(v, Slot):
            yield v.index
        elif isinstance(v, (list, tuple)):
            for x in v:
                yield from slots(x)

    for si, step in enumerate(plan.steps):
        if isinstance(step, KernelStep):
            read = [a.slot for a in step.args if isinstance(a, In)]
        else:
            assert isinstance(step, TorchStep)
            read = [*slots(step.args), *slots(list(step.kwargs.values()))]
        bad += [f"step {si} reads dead slot {s}" for s in read if s in dead]
        dead |= set(plan.frees[si])
    bad += [
        f"output slot {s.index} is dead"
        for s in plan.outputs
        if isinstance(s, Slot) and s.index in dead
    ]
    return bad


def test_torch_made_intermediates_are_dropped_and_overwritten_in_place() -> None:
    """A torch result read for the last time by a kernel is released after it, or written
    over by the kernel's output; nothing dead is read again."""

    def f(x, w):  # type: ignore[no-untyped-def]
        h = torch.nn.functional.gelu(x @ w)  # mm: torch; gelu may write over its result
        return torch.cumsum(h, 1).sigmoid() + h

    m = Fn(f).eval()
    args = (torch.randn(64, 32), torch.randn(32, 48))
    fast = opfuse.compile(m, args, options=pipeline.Options(implementation="unfused"))
    plan = fast._first.compiled.run.plan
    assert _dead_reads(plan) == []
    assert any(plan.frees), "dead torch results should be released during the call"
    stolen = [
        a
        for s in plan.steps
        for a in getattr(s, "args", [])
        if getattr(a, "steal", None) is not None
    ]
    assert stolen, "gelu should be allowed to write over the mm result"
    for _ in range(3):  # steady state: the stolen buffer is reused safely every call
        assert_matches_eager(m, fast(*args), args)


def test_training_plans_never_read_dead_slots() -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    from opfuse.runtime import execute as rt

    before = set(rt._LIVE)
    x = torch.randn(5, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.compile(m, backend="opfuse")(x).sum().backward()
    g = x.grad
    m.zero_grad()
    m(x2).sum().backward()
    torch.testing.assert_close(g, x2.grad)
    for r in set(rt._LIVE) - before:
        assert _dead_reads(r.plan) == []


def test_memory_table_has_inductor_freezing_column_and_leaves_training_blank() -> None:
    from opfuse.bench.run import Result, markdown

    mb = 1 << 20
    inference = Result("block", "memory")
    inference.memory = {
        "process": {
            "eager": 300 * mb,
            "inductor": 350 * mb,
            "inductor-freezing": 400 * mb,
            "opfuse": 270 * mb,
        }
    }
    training = Result("train step", "memory")
    training.memory = {"process": {"eager": 200 * mb, "inductor": 150 * mb, "opfuse": 100 * mb}}
    text = markdown([inference, training], "t")
    assert "| block | process | 300 | 350 | 400 | 270 | -10% |" in text
    assert "| train step | process | 200 | 150 |  | 100 | -50% |" in text


def test_fresh_process_compile_table() -> None:
    from opfuse.bench.run import Result, markdown

    r = Result("bert", "memory")
    r.memory = {"process": {"eager": 1, "inductor": 1, "inductor-freezing": 1, "opfuse": 1}}
    r.compile_seconds = {
        "inductor fresh process": 20.0,
        "inductor-freezing fresh process": 24.0,
        "opfuse fresh process": 5.0,
    }
    text = markdown([r], "t")
    assert "| cold compile: fresh process" in text
    assert "| bert | 20.0 | 24.0 | 5.0 | 0.25 |" in text


def test_kernels_build_as_parallel_units_into_one_library(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "MIN_UNIT_CHARS", 1)
    monkeypatch.setattr(build, "_cores", lambda: 2)
    header = "static int shared(int n) { return n + 1; }\n"
    pieces = [f"int k{i}(void *a, int n) {{ (void)a; return shared(n) * {i}; }}" for i in range(5)]
    assert [len(u) for u in build._split(pieces, 2)] == [3, 2]
    lib = build.build(pieces, header)
    assert [lib.fn(f"k{i}")(None, 2) for i in range(5)] == [0, 3, 6, 9, 12]
    assert not lib.cached and build.build(pieces, header).cached
    assert not list(fresh_cache.glob("tmp*"))  # units and objects removed
    partial = build.build([*pieces[:2], "int broken(void *a, int n) { return }"], header)
    assert partial.rejected == [2] and partial.fn("k1")(None, 2) == 3
    assert not list(fresh_cache.glob("tmp*"))

    def no_process(*args: Any, **kwargs: Any) -> Any:
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(build.subprocess, "Popen", no_process)
    with pytest.raises(build.BuildError, match="could not run"):
        build.build([*pieces, "int k9(void *a, int n) { return 9; }"], header)
    assert not list(fresh_cache.glob("tmp*"))


def _all_gone(pids: list[str], within: float = 5.0) -> bool:
    """Have the processes ended (SIGKILL is delivered asynchronously: on a loaded machine
    a killed process can take a moment to become a zombie)?"""
    import time

    end = time.monotonic() + within
    while any(_alive(int(p)) for p in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _fake_cc(tmp_path: Path, answers_version: bool) -> tuple[Path, Path]:
    """A compiler that hangs (after starting a child of its own, as gcc starts cc1),
    optionally after answering --version; it logs its children's pids."""
    log = tmp_path / "children"
    cc = tmp_path / ("hangs-on-build" if answers_version else "hangs")
    version = (
        'if [ "$1" = --version ]; then echo fakecc 1.0; exit 0; fi\n' if answers_version else ""
    )
    cc.write_text(f"#!/bin/sh\n{version}sleep 1000 &\necho $! >> {log}\nwait\n")
    cc.chmod(0o755)
    return cc, log


@pytest.mark.parametrize("answers_version", [False, True])
def test_a_hanging_compiler_costs_its_timeout_once_and_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch, fresh_cache: Path, tmp_path: Path, answers_version: bool
) -> None:
    import time

    cc, log = _fake_cc(tmp_path, answers_version)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(build, "_broken", {})
    # A timeout well above a capture's own time (torch.export of a fresh graph, up to a
    # second on a loaded machine), so that the second compile's time says it waited for none.
    timeout = 2.0
    monkeypatch.setattr(build, "PROBE_TIMEOUT", timeout)
    monkeypatch.setattr(build, "BUILD_TIMEOUT", timeout)
    m, args = model(), inputs()
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="could not be built.*hung"):
        fast = opfuse.compile(m, args)
    assert time.perf_counter() - t0 > timeout
    assert [g.pattern for g in fast.report.groups] == ["fallback"]
    assert_matches_eager(m, fast(*args), args)
    started = log.read_text().split()
    assert started and _all_gone(started)  # the whole group killed
    pipeline._warned.clear()
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="could not be built.*hung"):
        again = opfuse.compile(m, (args[0] + 1, args[1]))  # a new graph, no new attempt
    assert time.perf_counter() - t0 < timeout
    assert log.read_text().split() == started
    assert_matches_eager(m, again(args[0] + 1, args[1]), (args[0] + 1, args[1]))


def two_kernels_and_a_matmul() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    m = Fn(lambda x, w, y: (torch.relu(x * 2) @ w, torch.tanh(y) + 1)).eval()
    return m, (torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 4))


def test_a_library_that_does_not_load_falls_back_kernel_by_kernel(
    monkeypatch: pytest.MonkeyPatch, fresh_cache: Path, tmp_path: Path
) -> None:
    cc = tmp_path / "garbage-cc"  # "builds" a file the loader refuses
    cc.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo garbage 1.0; exit 0; fi\n'
        'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then echo junk > "$2"; fi; shift; done\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(build, "_broken", {})
    m, args = two_kernels_and_a_matmul()
    with pytest.warns(RuntimeWarning, match="do not load"):
        fast = opfuse.compile(m, args)
    assert "fallback" in [g.pattern for g in fast.report.groups]
    assert "library" in [g.pattern for g in fast.report.groups]  # the matmul still runs
    assert_matches_eager(m, fast(*args), args)


def test_a_kernel_the_compiler_rejects_runs_with_torch_alone(
    monkeypatch: pytest.MonkeyPatch, fresh_cache: Path
) -> None:
    from opfuse.backends.c import module

    real = module.render_module

    def one_broken(named: Any) -> str:
        text = real(named)
        return text + "\n#error rejected\n" if "tanh" in named[0][0] else text

    monkeypatch.setattr(module, "render_module", one_broken)
    m, args = two_kernels_and_a_matmul()
    with pytest.warns(
        RuntimeWarning, match="1 of 4 kernels could not be built .*fused_tanh_add.*#error rejected"
    ):
        fast = opfuse.compile(m, args)
    patterns = {g.ops[0].split(".")[1]: g.pattern for g in fast.report.groups}
    assert patterns["mul"] == "elementwise" and patterns["tanh"] == "fallback", patterns
    assert_matches_eager(m, fast(*args), args)


def test_build_leaves_out_only_the_pieces_the_compiler_rejects(fresh_cache: Path) -> None:
    pieces = [f"int k{i}(void *a, int n) {{ (void)a; return n * {i}; }}" for i in range(3)]
    lib = build.build([pieces[0], "int broken(void) { return }", pieces[2]])
    assert lib.rejected == [1] and "error: expected expression" in lib.problem
    assert lib.fn("k0")(None, 2) == 0 and lib.fn("k2")(None, 2) == 4
    with pytest.raises(build.BuildError, match="failed"):
        build.build(["int broken(void) { return }"])


def test_an_unusable_cache_directory_warns_about_the_cache_and_still_builds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    base._scratch_cache.cache_clear()
    m, args = model(), inputs()
    with pytest.warns(RuntimeWarning, match="kernel cache .* cannot be used") as seen:
        fast = opfuse.compile(m, args)
    assert not any("compiler" in str(w.message) for w in seen)
    assert [g.pattern for g in fast.report.groups] == ["elementwise"]
    assert_matches_eager(m, fast(*args), args)
