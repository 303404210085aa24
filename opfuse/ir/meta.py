"""Shape, stride and dtype of a new op application, from torch's own meta functions."""

from __future__ import annotations

from typing import Any

import torch

from .graph import Node, TensorMeta, contiguous_strides, map_args
from .size import Size


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
    return _to_meta(out, device, _known_sizes(args, kwargs))


def _known_sizes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, Size]:
    """The Sizes among the arguments' sizes, strides and int arguments, by value: torch's
    meta functions return plain ints, and a result size with the value of an argument's
    Size is given that Size back (ir/size.py: a Size printed where its value is meant is
    correct at any size; only kernels that print the same expressions share code)."""
    found: dict[int, Size] = {}

    def visit(v: Any) -> Any:
        if isinstance(v, Node) and isinstance(v.meta, TensorMeta):
            for x in (*v.meta.shape, *v.meta.stride):
                if isinstance(x, Size):
                    found.setdefault(int(x), x)
        elif isinstance(v, Size):
            found.setdefault(int(v), v)
        return v

    map_args(args, visit)
    for v in kwargs.values():
        map_args(v, visit)
    return found


def _to_meta(v: Any, device: str, known: dict[int, Size] | None = None) -> Any:
    if isinstance(v, torch.Tensor):
        sized = known or {}
        shape = tuple(sized.get(int(s), int(s)) for s in v.shape)
        stride = tuple(int(s) for s in v.stride())
        if sized and stride == contiguous_strides(shape):
            stride = contiguous_strides(shape)  # products of the shape's Sizes
        elif sized:
            stride = tuple(sized.get(s, s) for s in stride)
        return TensorMeta(shape, stride, v.dtype, device, int(v.storage_offset()))
    if isinstance(v, (tuple, list)):
        return tuple(_to_meta(x, device, known) for x in v)
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
