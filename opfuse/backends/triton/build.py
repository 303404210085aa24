"""Triton kernels of a graph -> one Python module in the kernel cache -> launchers.

Every group runs its generated kernel when it has one that renders (an epilogue group:
the library call with torch, then the epilogue kernel), or with torch. Nothing is timed:
the CPU candidates (oneDNN post-ops, blocked and packed GEMMs) do not exist here, and a
fused kernel does not lose to the same ops run one by one with torch on a GPU.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ...ir.graph import Graph, TensorMeta
from ...lower.groups import Lowered
from ...lower.kernel import Kernel
from ...runtime.plan import Built, BuiltKernel
from ..base import Make, Module, cache_dir
from .libdevice import interpreting
from .render import NotRenderable, render_kernel, render_module

_lock = threading.Lock()
log = logging.getLogger("opfuse.triton")


class TritonUnavailable(RuntimeError):
    """triton is not installed (or cannot be imported)."""


@dataclass
class Launcher:
    """A kernel's launcher as a plan step calls it: with the buffers as tensors (`tensors`
    tells the runtime so), not as the C kernels' array of addresses."""

    fn: Any
    tensors: bool = True

    def __call__(self, args: Any, nthreads: int = 0) -> int:
        return int(self.fn(args, nthreads))


def load(source: str) -> tuple[ModuleType, bool]:
    """Import `source` as a module kept in the kernel cache (triton.jit reads a kernel's
    source from its file); (module, whether the file was already there)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise TritonUnavailable(f"the Triton backend needs triton installed ({e})") from e
    key = hashlib.sha256(source.encode()).hexdigest()[:40]
    d = cache_dir() / "triton"
    d.mkdir(mode=0o700, exist_ok=True)
    path = d / f"k{key}.py"
    # triton.jit fixes interpreted or compiled when the module is imported
    name = f"opfuse_triton_k{key}" + ("_interpreted" if interpreting() else "")
    with _lock:
        cached = path.exists() and path.read_text() == source
        if not cached:
            fd, tmp = tempfile.mkstemp(dir=d, suffix=".py")
            with os.fdopen(fd, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        mod = sys.modules.get(name)
        if mod is None:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
    return mod, cached


def build_module(graph: Graph, lowered: Lowered) -> Module:
    kernels: dict[int, tuple[str, str, Kernel]] = {}  # group -> (candidate, name, kernel)
    for gid, cands in lowered.candidates.items():
        for cname in ("kernel", "unfused"):
            c = cands.get(cname)
            if isinstance(c, Kernel):
                name = f"{c.name}_{gid}" if cname == "kernel" else f"{c.name}_{cname}_{gid}"
                kernels[gid] = (cname, name, c)
                break
    rendered: dict[int, str] = {}
    gpu = _on_gpu(graph)
    for gid, (_, name, k) in kernels.items():
        try:
            rendered[gid] = render_kernel(name, k, checks=not gpu)
        except NotRenderable:
            continue  # torch runs the group
    source = render_module(list(rendered.values())) if rendered else ""
    mod = Module(source)
    lib: ModuleType | None = None
    if rendered and not (gpu or interpreting()):
        mod.problem = (
            "opfuse: Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1); "
            "running those ops with torch"
        )
    elif rendered:
        try:
            lib, mod.cached = load(source)
        except Exception as e:  # triton missing, or the source does not import
            mod.problem = f"opfuse: Triton kernels could not be built, running with torch ({e})"
    metas = {n.name: n.meta for n in graph.nodes}
    for gid in lowered.candidates:
        makers: dict[str, Make] = {}
        if gid in kernels and gid in rendered and lib is not None:
            cname, name, k = kernels[gid]
            fn = getattr(lib, name)
            if _trial(k, fn, [metas[b.value] for b in k.buffers]):
                makers[cname] = functools.partial(_built, k, fn)
            else:
                makers["torch"] = _torch_runs
        else:
            makers["torch"] = _torch_runs
        mod.candidates[gid] = makers
        mod.signatures[gid] = [rendered.get(gid, "torch")]
    return mod


def _trial(k: Kernel, fn: Any, metas: list[TensorMeta]) -> bool:
    """Launch the kernel once on scratch buffers laid out as its buffers' values (`metas`):
    Triton compiles on the first launch, and a kernel it cannot compile must fail here,
    where torch can still run the group, not inside a model's call."""
    import torch

    args = [
        torch.zeros(m.span, dtype=m.dtype, device=m.device).as_strided(m.shape, m.stride)
        for m in metas
    ]
    try:
        fn(args, 0)
    except Exception as e:  # any compile or launch failure
        log.warning("Triton kernel %s failed its trial launch, torch runs it: %s", k.name, e)
        return False
    return True


def _on_gpu(graph: Graph) -> bool:
    return any(d.startswith("cuda") for d in graph.devices)


def _built(k: Kernel, fn: Any) -> Built:
    return BuiltKernel(k, Launcher(fn))


def _torch_runs() -> None:
    return None
