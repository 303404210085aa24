"""Library outputs recycled between calls: a compiled call's torch-allocated blocks (oneDNN
convolution outputs, results of torch ops the plan calls, the caller's fresh outputs) come
from a cache of the blocks its earlier calls freed.

Fused kernels write into the plan's pool, but a library call allocates its output through
torch's CPU allocator, i.e. malloc, and glibc maps blocks above its mmap threshold (32 MiB
at most) afresh on every allocation and hands freed heap tops back to the OS: each call
then faults those pages in again (~1 us a page here). MobileNetV2 at batch 8, whose
112 x 112 maps are up to 38.5 MB: 17-24k faults and 38-49 ms a call; with the arena none
and 20-24 ms.

`arena.cpp` puts an allocator in front of torch's CPU allocator. On a thread inside a
compiled call (`Arena.enter`) it serves blocks of 64 KiB or more from the arena's cache
(the block freed last that fits, if under twice the size), else fresh; everywhere else it
passes every request to the allocator it replaced. A freed block goes back to the cache
while the cache holds less than the most one call took (MobileNetV2 batch 8: 112 MB cached,
51 MB out at once at most), else to the OS. The runtimes alive share one arena, freed when
the last of them goes (a training step's backward reuses what its forward's saved tensors
leave). A forked child bypasses it. Built with the C++ compiler against the headers of the
torch in the process; where that fails (no compiler, no headers) or `OPFUSE_NO_ARENA=1`,
calls run without it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..settings import flag

log = logging.getLogger("opfuse")

_SOURCE = Path(__file__).with_name("arena.cpp")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if flag("OPFUSE_NO_ARENA"):
        return None
    from ..backends.base import BuildError
    from ..backends.c.build import build_torch_extension

    try:
        lib = build_torch_extension(_SOURCE.read_text())
    except (BuildError, OSError) as e:
        log.info("opfuse: library outputs are not recycled (%s)", e)
        return None
    lib.opfuse_arena_new.restype = ctypes.c_void_p
    lib.opfuse_arena_enter.restype = ctypes.c_void_p
    lib.opfuse_arena_enter.argtypes = [ctypes.c_void_p]
    lib.opfuse_arena_exit.argtypes = [ctypes.c_void_p]
    lib.opfuse_arena_close.argtypes = [ctypes.c_void_p]
    lib.opfuse_arena_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
    if lib.opfuse_arena_install() != 1:
        log.info("opfuse: library outputs are not recycled (another CPU allocator has priority)")
        return None
    return lib


@dataclass(frozen=True)
class ArenaStats:
    fresh: int  # blocks allocated anew
    reused: int  # blocks served from the cache
    cached: int  # bytes in the cache now
    limit: int  # the most bytes one call took: what the cache may hold
    peak: int  # the most bytes out at once


class Arena:
    """A cache of freed blocks. `enter()` makes it the calling thread's until `exit(token)`;
    calls on other threads may share it (the C side locks)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self.handle = lib.opfuse_arena_new()
        self.enter = functools.partial(lib.opfuse_arena_enter, self.handle)
        self.exit = lib.opfuse_arena_exit
        # blocks still out when the last runtime goes are freed when they come back
        weakref.finalize(self, lib.opfuse_arena_close, self.handle)

    def stats(self) -> ArenaStats:
        out = (ctypes.c_uint64 * 5)()
        self._lib.opfuse_arena_stats(self.handle, out)
        return ArenaStats(*out)


_shared: weakref.ref[Arena] | None = None


def new_arena() -> Arena | None:
    """The arena runtimes share (made anew once none holds it), or None where the
    allocator is not available. One for all: a training step's backward then reuses the
    blocks its forward's saved tensors leave, and several compiled models keep one cache,
    not one each."""
    global _shared
    lib = _library()
    if lib is None:
        return None
    arena = _shared() if _shared is not None else None
    if arena is None:
        arena = Arena(lib)
        _shared = weakref.ref(arena)
    return arena
