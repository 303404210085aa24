"""The backend contract: what a backend's build_module(graph, lowered) returns (a Module:
its source and, per group, how to make each candidate implementation), how a library
refuses a candidate (Unavailable), how building fails (BuildError), and the cache directory
every backend keeps its built code in. Backends import from here and from plan's Built*
types, never from each other."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..runtime.plan import Built


class BuildError(RuntimeError):
    """The C compiler is missing or rejected the generated source."""


class UnsafeCacheError(BuildError):
    """The cache directory or a cached file can be written by another user."""


# Builds one candidate: prepacks its weights, binds its kernel. Returns None where torch runs
# the group; raises Unavailable where a library refuses it (then it is no candidate).
Make = Callable[[], "Built | None"]


class Unavailable(Exception):
    """The library refuses this candidate (a dtype or layout it does not take)."""


@dataclass
class Module:
    """The built library and, per group, how to make each candidate. Candidates are made
    on demand: prepacked weights of the candidates not chosen never coexist."""

    source: str
    candidates: dict[int, dict[str, Make]] = field(default_factory=dict)
    # What each candidate computes, independent of names: groups with equal signatures
    # (the layers of a Transformer) share one timing decision.
    signatures: dict[int, list[str]] = field(default_factory=dict)
    cached: bool = True
    problem: str = ""  # why nothing was built (the compiler failed)
    # its kernels printed Sizes as expressions of the size symbols (backends/c: a graph
    # with symbolic sizes), those in `valued` (by name) some as their values: the library
    # serves any size of the graph where the kernels run are not `valued`
    generic: bool = False
    valued: set[str] = field(default_factory=set)
    kernels: dict[str, str] = field(default_factory=dict)  # each kernel's source, by name
    # (group, candidate) -> the groups before it whose work that candidate does too (a
    # depthwise convolution feeding a matmul, and the matmul before it: lower/dw_gemm.py);
    # the tuner times them together
    absorbs: dict[tuple[int, str], tuple[int, ...]] = field(default_factory=dict)

    def running(self, built: Iterable[Built]) -> tuple[bool, str]:
        """Of the candidates chosen (`built`; those not chosen may differ at other sizes):
        whether they serve every size of the graph (`generic`, none `valued`), and their
        kernels' source. A built kernel is known by its function's name, which a
        library's (ctypes) function takes from its symbol: the kernel's name."""
        runs = {getattr(getattr(b, "fn", None), "__name__", "") for b in built}
        text = "".join(t for n, t in self.kernels.items() if n in runs)
        return self.generic and not runs & self.valued, text


def cache_dir() -> Path:
    """The kernel cache. One that cannot be created or written (a read-only home) is
    replaced, for this process, by a private temporary directory, with a warning: the
    kernels still build, they are only not kept."""
    root = os.environ.get("OPFUSE_CACHE_DIR")
    if root:
        d = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = Path(xdg) / "opfuse"
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        writable = os.access(d, os.W_OK | os.X_OK)
    except OSError as e:
        writable, why = False, str(e)
    else:
        why = "not writable"
    if writable:
        check_private(d)
        return d
    return _scratch_cache(str(d), why)


@functools.cache
def _scratch_cache(wanted: str, why: str) -> Path:
    warnings.warn(
        f"opfuse: the kernel cache {wanted} cannot be used ({why}); kernels are built in a "
        "temporary directory and not kept. Set OPFUSE_CACHE_DIR to a writable directory",
        RuntimeWarning,
        stacklevel=2,
    )
    d = Path(tempfile.mkdtemp(prefix="opfuse-cache-"))  # created 0700
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


def check_private(p: Path) -> None:
    st = p.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise UnsafeCacheError(f"{p} belongs to another user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(f"{p} can be written by other users")
