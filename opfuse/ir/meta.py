"""Shape, stride and dtype of a new op application, from torch's own meta functions."""

from __future__ import annotations

from typing import Any

import torch

from .graph import Node, TensorMeta, map_args


def _fake(m: TensorMeta) -> torch.Tensor:
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")


def infer_meta(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run `target` on meta tensors standing in for the Node arguments. The result lives
    on the device an argument names (a factory's `device=`, opfuse.seed's), else on the
    first tensor argument's."""
    device = _named_device(args, kwargs)
    if device is None:
        device = "cpu"
        for a in _nodes(args, kwargs):
            if isinstance(a.meta, TensorMeta):
                device = a.meta.device
                break
    margs = tuple(_on_meta(map_args(a, lambda n: _fake(n.tensor))) for a in args)
    mkwargs = {
        k: "meta" if k == "device" else map_args(v, lambda n: _fake(n.tensor))
        for k, v in kwargs.items()
    }
    out = target(*margs, **mkwargs)
    return _to_meta(out, device)


def _named_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.device):
            return device_name(v)
    d = kwargs.get("device")
    return device_name(torch.device(d)) if isinstance(d, str) else None


def device_name(d: torch.device) -> str:
    """A device as tensors on it print theirs: 'cuda' names the current CUDA device,
    'cuda:0', as a tensor made there says."""
    if d.index is None and d.type != "cpu" and d.type != "meta":
        mod = getattr(torch, d.type, None)
        if mod is not None and hasattr(mod, "current_device") and mod.is_available():
            return f"{d.type}:{mod.current_device()}"
    return str(d)


def _on_meta(v: Any) -> Any:
    return "meta" if isinstance(v, torch.device) else v


def _to_meta(v: Any, device: str) -> Any:
    if isinstance(v, torch.Tensor):
        return TensorMeta(
            tuple(int(s) for s in v.shape),
            tuple(int(s) for s in v.stride()),
            v.dtype,
            device,
            int(v.storage_offset()),
        )
    if isinstance(v, (tuple, list)):
        return tuple(_to_meta(x, device) for x in v)
    return None


def _nodes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Node]:
    out: list[Node] = []

    def visit(v: Any) -> Any:
        out.append(v)
        return v

    map_args(args, visit)
    for v in kwargs.values():
        map_args(v, visit)
    return out
