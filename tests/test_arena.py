"""The arena: library outputs of a compiled call come from blocks its earlier calls freed
(runtime/arena.py), never from a block still in use, and nothing changes outside calls."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.runtime.arena import new_arena

pytestmark = pytest.mark.skipif(new_arena() is None, reason="no C++ compiler or torch headers")


class Expand(nn.Module):
    """MobileNetV2's expansion: 1x1 conv (oneDNN, output allocated by torch) + ReLU6, a
    depthwise conv, a projection; outputs of several hundred KB."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(8, 48, 1)
        self.dw = nn.Conv2d(48, 48, 3, padding=1, groups=48)
        self.project = nn.Conv2d(48, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.relu6(self.expand(x))
        y = nn.functional.relu6(self.dw(y))
        return self.project(y) + x


def _compiled() -> tuple[nn.Module, opfuse.CompiledModule, torch.Tensor]:
    torch.manual_seed(0)
    m = Expand().eval()
    x = torch.randn(2, 8, 48, 48)
    return m, opfuse.compile(m, (x,)), x


def _arena(fast: opfuse.CompiledModule):  # type: ignore[no-untyped-def]
    arena = fast._first.compiled.run.arena
    assert arena is not None
    return arena


def test_warm_calls_reuse_blocks_and_match_eager() -> None:
    m, fast, x = _compiled()
    with torch.no_grad():
        for _ in range(2):
            fast(x)
        before = _arena(fast).stats()
        for _ in range(5):
            torch.testing.assert_close(fast(x), m(x))
    after = _arena(fast).stats()
    assert before.fresh > 0  # the library calls' outputs went through it
    assert after.fresh == before.fresh  # warm: nothing new
    assert after.reused > before.reused
    assert after.cached <= after.limit


def test_held_outputs_are_never_handed_out_again() -> None:
    m, fast, x = _compiled()
    with torch.no_grad():
        kept = [(x * k, fast(x * k)) for k in (1.0, -2.0, 0.5, 3.0)]  # all alive at once
        for xi, out in kept:
            torch.testing.assert_close(out, m(xi))
    ptrs = [out.data_ptr() for _, out in kept]
    assert len(set(ptrs)) == len(ptrs)


def test_outputs_outlive_the_compiled_model() -> None:
    m, fast, x = _compiled()
    with torch.no_grad():
        out, want = fast(x), m(x)
    stats = _arena(fast).stats()
    assert stats.limit > 0
    del fast
    gc.collect()
    torch.empty(1 << 20).fill_(7.0)  # allocations go on
    torch.testing.assert_close(out, want)
    del out  # back to a closed arena: freed


def test_allocations_outside_calls_pass_through() -> None:
    _, fast, x = _compiled()
    with torch.no_grad():
        fast(x)
    before = _arena(fast).stats()
    big = [torch.empty(1 << 20) for _ in range(4)]
    del big
    assert _arena(fast).stats() == before


def test_calls_from_threads_share_it() -> None:
    m, fast, _ = _compiled()
    inputs = [torch.randn(2, 8, 48, 48) for _ in range(4)]
    with torch.no_grad():
        want = [m(t) for t in inputs]
    got: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        with torch.no_grad():
            for _ in range(3):
                got[i] = fast(inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        torch.testing.assert_close(got[i], want[i])


def test_training_through_torch_compile() -> None:
    torch.manual_seed(0)
    m = Expand()
    ref = Expand()
    ref.load_state_dict(m.state_dict())
    fast = torch.compile(m, backend="opfuse")
    x = torch.randn(2, 8, 48, 48)
    for _ in range(3):
        fast(x).square().sum().backward()
        ref(x).square().sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "env",
    [
        {"OPFUSE_NO_ARENA": "1"},
        {"CXX": "/nonexistent/c++"},  # no C++ compiler: a fresh cache has no allocator to load
        {"CXX": "false"},  # one that fails
    ],
)
def test_turned_off_or_unavailable(env: dict[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    child = (
        "import torch, opfuse; from tests.test_arena import _compiled; "
        "m, fast, x = _compiled(); "
        "torch.testing.assert_close(fast(x), m(x)); "
        "print(fast._first.compiled.run.arena)"
    )
    out = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OPFUSE_CACHE_DIR": str(tmp_path), **env},
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "None"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_runs_and_frees() -> None:
    # a DataLoader worker: the child inherits the allocator, the arenas and held outputs
    m, fast, x = _compiled()
    with torch.no_grad():
        held = fast(x)
        want = m(x)
    pid = os.fork()
    if pid == 0:  # the child: run, free what the parent's arena handed out, exit
        code = 1
        try:
            # as a DataLoader worker does: libgomp's team does not survive a fork (the
            # child's first parallel region waits forever, with torch alone too)
            torch.set_num_threads(1)
            with torch.no_grad():
                ok = torch.allclose(fast(x), want, rtol=1e-4, atol=1e-4)
            ok = ok and torch.allclose(held, want, rtol=1e-4, atol=1e-4)
            del fast
            gc.collect()
            code = 0 if ok else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    torch.testing.assert_close(held, want)
