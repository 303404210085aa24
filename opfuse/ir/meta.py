"""Shape, stride and dtype of a new op application, from torch's own meta functions."""

from __future__ import annotations

from typing import Any

import torch

from .graph import Node, TensorMeta, map_args


def _fake(m: TensorMeta) -> torch.Tensor:
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")


def infer_meta(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run `target` on meta tensors standing in for the Node arguments."""
    device = "cpu"
    for a in _nodes(args, kwargs):
        if isinstance(a.meta, TensorMeta):
            device = a.meta.device
            break
    margs = map_args(args, lambda n: _fake(n.tensor))
    mkwargs = {k: map_args(v, lambda n: _fake(n.tensor)) for k, v in kwargs.items()}
    if "device" in mkwargs:
        mkwargs["device"] = "meta"
    out = target(*margs, **mkwargs)
    return _to_meta(out, device)


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
