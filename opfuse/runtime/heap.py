"""The process heap's policy: what compiling hands back to the OS, and (on request) what
running keeps; Python's garbage collector waits while a compile runs.

Library calls (oneDNN convolutions, MKL linears) allocate their outputs through torch's CPU
allocator, which is glibc's malloc. glibc returns a freed block at the top of its heap to the
OS once more than its trim threshold (twice the largest freed mapped block, at most 64 MiB)
lies free there, and maps blocks above its mmap threshold afresh on every allocation; the
next call then faults every page in again (~1 us a page on this VM). MobileNetV2 batch 8:
16-24k faults per call (65-100 MB) for opfuse and inductor alike, 90-100 ms a call; with the
heap kept, 0 faults and 57 ms for both. Eager: 65-100k faults per call."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import sys
from collections.abc import Iterator

import torch

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit systems
TRIM_THRESHOLD = 1 << 30
HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_MADV_HUGEPAGE = 14  # Linux's madvise advice (asm-generic/mman-common.h)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc has it; musl and others do not)
        return libc
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand the heap that compiling freed (timing inputs, losing candidates' packed weights)
    back to the OS: glibc keeps freed heap pages resident, and a compiled model would
    otherwise carry tens of MB of them for its lifetime."""
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(OSError):
            libc.malloc_trim(0)


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for the next allocation instead of returning it to the
    OS (blocks up to 32 MiB from the heap, and the heap never trimmed below 1 GiB free), so
    that a warm call of any model in this process faults no pages in. A process-wide
    setting, as the MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ environment variables
    are; the process's resident memory then stays at its peak. False where the C library
    is not glibc (nothing changed)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while compiling. A compile allocates some
    hundred thousand objects, enough to start full collections, and a full collection walks
    every object of the process (torch's alone: 0.15-0.36 s with a model's graphs
    loaded), a tenth of ResNet-50's compile and most of a BERT length's now and then. What
    the compile leaves as garbage is collected after, as young objects."""
    if not gc.isenabled():
        yield  # (a caller's own pause, or a nested compile)
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def weight_buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty buffer for a packed weight, on huge pages where Linux gives them on request
    (transparent huge pages in `madvise` mode, the common default). The pages are advised
    before the packing touches them; elsewhere, or below two huge pages, a plain
    torch.empty."""
    nbytes = numel * dtype.itemsize
    libc = _libc()
    if libc is None or not sys.platform.startswith("linux") or nbytes < 2 * HUGE_PAGE:
        return torch.empty(numel, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    addr = raw.data_ptr()
    skip = -addr % HUGE_PAGE
    span = (nbytes + HUGE_PAGE - skip) // HUGE_PAGE * HUGE_PAGE
    with contextlib.suppress(OSError, AttributeError):
        libc.madvise(ctypes.c_void_p(addr + skip), ctypes.c_size_t(span), _MADV_HUGEPAGE)
    return raw[skip : skip + nbytes].view(dtype)
