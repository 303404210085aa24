"""Compile generated C, cache the shared library on disk, load it.

The cache lives in $OPFUSE_CACHE_DIR, else $XDG_CACHE_HOME/opfuse, else ~/.cache/opfuse,
created 0700. A library is keyed by a hash of its source, the compiler's identity and the
flags. Loading refuses a directory or file that another user can write (it would let them
run code in this process) and checks the library against the digest written when it was
built, so a truncated or corrupt file is rebuilt. Builds write to a temporary file and
rename it into place, so two processes compiling the same kernels at once both succeed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..base import BuildError, cache_dir, check_private
from .prelude import MVEC_235, MVEC_BASE, build_prelude


class Rejected(BuildError):
    """The compiler ran and rejected the source (a kernel it cannot compile)."""


# Compilers that could not run or hung, by path, for the life of the process: each would
# cost its timeout again on every compile (a hanging CC: 30 s per probe, 120 s per build).
_broken: dict[str, BuildError] = {}


@dataclass(frozen=True)
class Toolchain:
    cc: str
    version: str
    flags: tuple[str, ...]
    libs: tuple[str, ...]
    prelude: str

    @property
    def fingerprint(self) -> str:
        return "\n".join([self.cc, self.version, *self.flags, *self.libs])


_BASE_FLAGS = (
    "-O3",
    "-std=gnu11",
    "-fPIC",
    "-shared",
    "-fopenmp",
    # errno is never read; dropping it lets sqrt/exp vectorise. Not -ffast-math: NaN, Inf
    # and signed zeros keep their IEEE meaning.
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fwrapv",  # integer overflow wraps, as in torch
    # Every op rounds as eager's does: GNU C contracts a*b+c across fused ops into one FMA,
    # and a value the backward recomputes must equal the forward's bit for bit (amax's
    # backward finds its maximum again with ==; a contracted recomputation matched nothing
    # and the gradient was 0/0).
    "-ffp-contract=off",
)


# Seconds a compiler may take: to print its version, and to build a library.
PROBE_TIMEOUT = 30.0
BUILD_TIMEOUT = 120.0


def _run(cmd: list[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run a compiler in a process group of its own: on a timeout the whole group (cc1,
    as, a wrapper script's children) is killed, not only the process we started."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout or BUILD_TIMEOUT)
    except BaseException:
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.communicate()  # reap it; its pipes closed with the group


@functools.lru_cache(maxsize=8)
def _probe(cc: str) -> Toolchain:
    try:
        out = _run([cc, "--version"], timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise BuildError(
            f"C compiler {cc!r} hung: no answer to --version in {e.timeout:g} s"
        ) from e
    except OSError as e:
        raise BuildError(f"C compiler {cc!r} cannot run: {e}") from e
    if out.returncode != 0:
        raise BuildError(f"C compiler {cc!r} failed: {out.stderr.strip()[:200]}")
    version = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else cc
    flags = list(_BASE_FLAGS)
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags.append("-march=native")
        if _has_avx512():
            # gcc defaults to 256-bit vectors on recent Intel parts; 512 is faster here.
            flags.append("-mprefer-vector-width=512")
    elif machine in ("aarch64", "arm64"):
        flags.append("-mcpu=native")
    mvec: tuple[str, ...] = ()
    libs = ["-lm"]
    if machine in ("x86_64", "amd64") and _glibc() >= (2, 22):
        mvec = MVEC_BASE + (MVEC_235 if _glibc() >= (2, 35) else ())
        libs.insert(0, "-lmvec")
    tc = Toolchain(cc, version, tuple(flags), tuple(libs), build_prelude(mvec))
    _check_openmp(tc)
    return tc


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


def _glibc() -> tuple[int, ...]:
    name, ver = platform.libc_ver()
    if name != "glibc" or not ver:
        return (0,)
    return tuple(int(x) for x in ver.split(".")[:2])


def _check_openmp(tc: Toolchain) -> None:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.c"
        src.write_text(tc.prelude + "int probe(void) { return omp_get_max_threads(); }\n")
        try:
            out = _run([tc.cc, *tc.flags, str(src), "-o", str(Path(d) / "probe.so"), *tc.libs])
        except subprocess.TimeoutExpired as e:
            raise BuildError(f"{tc.cc} hung building a test program ({e.timeout:g} s)") from e
        except OSError as e:
            raise BuildError(f"{tc.cc} cannot build: {e}") from e
        if out.returncode != 0:
            raise BuildError(f"{tc.cc} cannot build OpenMP code: {out.stderr.strip()[:300]}")


def toolchain() -> Toolchain:
    """The compiler opfuse uses: $CC, else cc/gcc on PATH. Raises BuildError if none, or
    if it failed or hung before in this process."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler found (set CC or install gcc)")
    path = shutil.which(cc)
    if path is None:
        raise BuildError(f"C compiler {cc!r} not found")
    if path in _broken:
        raise _broken[path]
    try:
        return _probe(path)
    except BuildError as e:
        _broken[path] = e
        raise


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_lock = threading.Lock()


@dataclass
class Library:
    """A loaded shared library of kernels: `fn(name)` gives a ctypes function."""

    path: Path
    handle: ctypes.CDLL | None  # None: every piece was rejected
    cached: bool  # True when it came from the disk cache rather than a fresh build
    rejected: list[int] = field(default_factory=list)  # pieces the compiler refused
    problem: str = ""  # why (the compiler's first line)

    def fn(self, name: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        f = getattr(self.handle, name)
        f.argtypes = [ctypes.c_void_p, ctypes.c_int]
        f.restype = ctypes.c_int
        return f


def build(pieces: Sequence[str], header: str = "") -> Library:
    """Compile kernel code (without the prelude) into a loaded library: each piece is
    self-contained given the prelude and `header`, so pieces may go to separate
    translation units compiled in parallel. Pieces the compiler rejects are left out
    (`Library.rejected`) and the rest is built; a compiler that cannot run or hangs, or a
    library that does not load, raises BuildError."""
    tc = toolchain()
    try:
        return _build(tc, list(pieces), header)
    except Rejected as e:
        if len(pieces) == 1:
            raise
        first = e
    rejected = [i for i, p in enumerate(pieces) if not _compiles(tc, header, p)]
    if not rejected:
        raise first  # only together: nothing to leave out
    keep = [p for i, p in enumerate(pieces) if i not in rejected]
    lib = _build(tc, keep, header) if keep else None
    return Library(
        lib.path if lib else Path(),
        lib.handle if lib else None,
        lib.cached if lib else False,
        rejected=rejected,
        problem=_first_error(str(first)),
    )


def _first_error(message: str) -> str:
    lines = message.splitlines()
    return next((ln.strip() for ln in lines if "error" in ln), lines[0] if lines else "")


def _build(tc: Toolchain, pieces: list[str], header: str) -> Library:
    parts = [tc.prelude + header, *pieces]
    key = hashlib.sha256((tc.fingerprint + "\0" + "\0".join(parts)).encode()).hexdigest()[:40]
    d = cache_dir()
    so = d / f"{key}.so"
    sig = d / f"{key}.sha256"
    with _lock:
        lib = _load_cached(so, sig)
        if lib is not None:
            return lib
        _compile(tc, parts[0], pieces, d, so, sig)
        try:
            return Library(so, ctypes.CDLL(str(so)), cached=False)
        except OSError as e:  # built, but the loader refuses it
            raise BuildError(f"the kernels built by {tc.cc} do not load: {e}") from e


def _compiles(tc: Toolchain, header: str, piece: str) -> bool:
    """Does this piece alone compile (to an object, not kept)?"""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "piece.c"
        src.write_text(tc.prelude + header + piece)
        with _compiler_faults(tc):
            out = _run([tc.cc, *tc.flags, "-c", str(src), "-o", str(Path(d) / "piece.o")])
        return out.returncode == 0


def _load_cached(so: Path, sig: Path) -> Library | None:
    if not so.exists() or not sig.exists():
        return None
    check_private(so)
    check_private(sig)
    if sig.read_text().strip() != _digest(so):
        return None  # truncated or corrupt: rebuild
    try:
        return Library(so, ctypes.CDLL(str(so)), cached=True)
    except OSError:
        return None


_runs = [0]  # libraries the compiler built in this process (not found in the cache)


def compiler_runs() -> int:
    """How many libraries the C compiler built in this process."""
    return _runs[0]


def _compile(tc: Toolchain, head: str, pieces: list[str], d: Path, so: Path, sig: Path) -> None:
    _runs[0] += 1
    with _compiler_faults(tc):
        _compile_units(tc, head, pieces, d, so, sig)


@contextlib.contextmanager
def _compiler_faults(tc: Toolchain) -> Iterator[None]:
    """A compiler that cannot start or hangs is a BuildError; one that hangs is not asked
    again in this process (a transient fork failure is no reason to give up)."""
    try:
        yield
    except subprocess.TimeoutExpired as e:
        _broken[tc.cc] = BuildError(f"{tc.cc} hung on a build: no answer in {e.timeout:g} s")
        raise _broken[tc.cc] from e
    except OSError as e:
        raise BuildError(f"{tc.cc} could not run: {e}") from e


def _compile_units(
    tc: Toolchain, head: str, pieces: list[str], d: Path, so: Path, sig: Path
) -> None:
    units = _split(pieces, _cores())
    written: list[str] = []
    tmp_so = ""
    try:
        for unit in units:
            fd, name = tempfile.mkstemp(suffix=".c", dir=d)
            written.append(name)
            with os.fdopen(fd, "w") as f:
                f.write(head + "\n".join(unit))
        tmp_so = written[0][:-2] + ".so"
        if len(written) == 1:
            _check(tc, _run([tc.cc, *tc.flags, written[0], "-o", tmp_so, *tc.libs]))
        else:
            # gcc takes one core: the units compile side by side, then link (ResNet-50 b8's
            # kernels, 2 cores: 0.45 -> 0.27 s)
            objs = [w[:-2] + ".o" for w in written]
            procs: list[subprocess.Popen[str]] = []
            try:
                for w, o in zip(written, objs, strict=True):
                    procs.append(
                        subprocess.Popen(
                            [tc.cc, *tc.flags, "-c", w, "-o", o],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE,
                            text=True,
                            start_new_session=True,  # killed as a group (see _run)
                        )
                    )
                for proc in procs:
                    _, err = proc.communicate(timeout=BUILD_TIMEOUT)
                    _check(tc, subprocess.CompletedProcess(proc.args, proc.returncode, "", err))
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        _kill_group(proc)
            _check(tc, _run([tc.cc, *tc.flags, *objs, "-o", tmp_so, *tc.libs]))
        _publish(tmp_so, d, so, sig)
    finally:
        for w in written:
            for p in (w, w[:-2] + ".o"):
                if os.path.exists(p):
                    os.unlink(p)
        if tmp_so and os.path.exists(tmp_so):
            os.unlink(tmp_so)


def _publish(tmp_so: str, d: Path, so: Path, sig: Path) -> None:
    """Move a built library into the cache with the digest loading checks."""
    os.chmod(tmp_so, 0o700)
    digest = _digest(Path(tmp_so))
    fd, tmp_sig = tempfile.mkstemp(suffix=".sha256", dir=d)
    with os.fdopen(fd, "w") as f:
        f.write(digest + "\n")
    os.replace(tmp_so, so)  # atomic: readers see the old file or the new one
    os.replace(tmp_sig, sig)


def _check(tc: Toolchain, out: subprocess.CompletedProcess[str]) -> None:
    if out.returncode != 0:
        raise Rejected(f"{tc.cc} failed:\n{out.stderr.strip()[:2000]}")


# Below this much kernel text a second unit costs more (the prelude parsed again, a link)
# than it saves.
MIN_UNIT_CHARS = 4000


def _split(pieces: list[str], cores: int) -> list[list[str]]:
    """Pieces in at most `cores` units of about equal text (each piece stands alone: the
    order within a unit does not matter)."""
    total = sum(len(p) for p in pieces)
    n = max(1, min(cores, len(pieces), total // MIN_UNIT_CHARS))
    units: list[list[str]] = [[] for _ in range(n)]
    sizes = [0] * n
    for p in sorted(pieces, key=len, reverse=True):  # largest first, into the emptiest
        k = sizes.index(min(sizes))
        units[k].append(p)
        sizes[k] += len(p)
    return [u for u in units if u]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def build_torch_extension(source: str) -> ctypes.CDLL:
    """Compile C++ that uses torch's C++ headers and libc10 (runtime/arena.cpp) with $CXX,
    else c++/g++, for the torch in this process; cached like kernels, keyed by the source,
    the compiler and torch. Raises BuildError where there is no C++ compiler, torch ships
    no headers, or the build fails."""
    import torch

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    root = Path(torch.__file__).parent
    include, lib = root / "include", root / "lib"
    if not cxx or shutil.which(cxx) is None:
        raise BuildError("no C++ compiler found (set CXX or install g++)")
    if not (include / "c10" / "core" / "Allocator.h").exists():
        raise BuildError(f"torch at {root} ships no C++ headers")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-std=c++17", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    libs = [f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
    try:
        version = _run([cxx, "--version"], timeout=PROBE_TIMEOUT).stdout.splitlines()[:1]
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"C++ compiler {cxx!r} cannot run: {e}") from e
    ident = "\0".join([cxx, *version, torch.__version__, str(root), *flags, source])
    key = "ext-" + hashlib.sha256(ident.encode()).hexdigest()[:40]
    d = cache_dir()
    so, sig = d / f"{key}.so", d / f"{key}.sha256"
    with _lock:
        cached = _load_cached(so, sig)
        if cached is not None and cached.handle is not None:
            return cached.handle
        fd, src = tempfile.mkstemp(suffix=".cpp", dir=d)
        tmp_so = src[:-4] + ".so"
        try:
            with os.fdopen(fd, "w") as f:
                f.write(source)
            try:
                out = _run([cxx, *flags, "-I", str(include), src, "-o", tmp_so, *libs])
            except (OSError, subprocess.TimeoutExpired) as e:
                raise BuildError(f"{cxx} could not run: {e}") from e
            if out.returncode != 0:
                raise BuildError(f"{cxx} failed:\n{out.stderr.strip()[:2000]}")
            _publish(tmp_so, d, so, sig)
        finally:
            for p in (src, tmp_so):
                if os.path.exists(p):
                    os.unlink(p)
        try:
            return ctypes.CDLL(str(so))
        except OSError as e:
            raise BuildError(f"the extension built by {cxx} does not load: {e}") from e
