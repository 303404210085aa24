"""Runs of kernel steps called from C: consecutive steps whose arguments are all fixed
(pooled blocks, constants, scratch) go to one C function that calls each kernel in turn,
instead of one trip through the Python step loop and ctypes per kernel.

Each such trip costs 1-2 us: MobileNetV3-Large at batch 1 is 72 kernels of 2-150 us, and
its call spent 0.15 ms of 1.8 outside them. A run ends at a step with an argument only
the call knows (the caller's input, a fresh output), a torch step, or a kernel that
carries value bounds for a guarded library call (finite.py): those stay in Python.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..settings import flag

log = logging.getLogger("opfuse")

_SOURCE = r"""
typedef int (*opfuse_kernel_fn)(void *const *args, int nthreads);

/* Call n kernels in order; the first nonzero status stops the run and comes back. */
extern "C" int opfuse_run_kernels(int n, void *const *fns, void *const *const *args,
                                  int nthreads) {
  for (int i = 0; i < n; i++) {
    const int err = ((opfuse_kernel_fn)fns[i])(args[i], nthreads);
    if (err) return err;
  }
  return 0;
}
"""

# Shortest run worth a C call of its own (a single kernel is called directly).
MIN_RUN = 2


@functools.lru_cache(maxsize=1)
def _runner() -> Any:
    """The C function that calls a run's kernels, or None (OPFUSE_NO_RUNS=1, or it does not
    build: then every step goes through Python, as before)."""
    if flag("OPFUSE_NO_RUNS"):
        return None
    from ..backends.base import BuildError
    from ..backends.c.build import build_torch_extension

    # Built as the arena is (cached on disk, once per machine and torch), not as a kernel
    # library: it is no compile's work.
    try:
        lib = build_torch_extension(_SOURCE)
    except (BuildError, OSError) as e:
        log.info("opfuse: kernels run one Python call each (%s)", e)
        return None
    fn = lib.opfuse_run_kernels
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@dataclass
class Run:
    """Kernel steps first..first + n - 1, called by one C call."""

    first: int
    n: int
    fns: Any  # void *[n]: the kernels
    args: Any  # void **[n]: their argument arrays
    # keeps the argument arrays the pointers in `args` point into alive
    arrays: list[Any]
    runner: Any  # opfuse_run_kernels

    def call(self, nthreads: int) -> int:
        """Run the kernels; the first nonzero status one returned, else 0."""
        return int(self.runner(self.n, self.fns, self.args, nthreads))


def address(fn: Any) -> int | None:
    """The C address of a ctypes kernel function; None for anything else (a Triton
    launcher, a Python wrapper)."""
    if not isinstance(fn, ctypes._CFuncPtr):  # type: ignore[attr-defined]
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


def find_runs(steps: Sequence[tuple[Any, Any] | None]) -> list[Run]:
    """The runs among a plan's `steps`: per step, (kernel function, its argument array)
    where it may join a run, else None."""
    runner = _runner()
    if runner is None:
        return []
    runs: list[Run] = []
    group: list[tuple[int, int, Any]] = []  # (step, kernel address, argument array)

    def close() -> None:
        if len(group) >= MIN_RUN:
            fns = (ctypes.c_void_p * len(group))(*(fn for _, fn, _ in group))
            ptrs = (ctypes.c_void_p * len(group))(
                *(ctypes.cast(arr, ctypes.c_void_p).value for _, _, arr in group)
            )
            arrays = [arr for _, _, arr in group]
            runs.append(Run(group[0][0], len(group), fns, ptrs, arrays, runner))
        group.clear()

    for si, s in enumerate(steps):
        fn = None if s is None else address(s[0])
        if s is None or fn is None:
            close()
        else:
            group.append((si, fn, s[1]))
    close()
    return runs
