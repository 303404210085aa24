"""Flatten model inputs and outputs to lists of leaves and rebuild them.

Covers what models return: tensors, tuples, lists, dicts, namedtuples, dataclasses (frozen
ones too) and every type registered with torch's pytree (the ModelOutput classes of
popular model libraries register themselves). Non-tensor leaves are kept in the spec, so a
compiled model returns exactly the structure eager returns.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree


@dataclass(frozen=True)
class Spec:
    kind: str  # 'tensor' | 'const' | 'seq' | 'dict' | 'namedtuple' | 'dataclass' | 'pytree'
    type: Any = None
    children: tuple[Spec, ...] = ()
    context: Any = None  # dict keys, dataclass field names, pytree context, const value
    index: int = -1  # tensor leaf position

    @property
    def num_tensors(self) -> int:
        if self.kind == "tensor":
            return 1
        return sum(c.num_tensors for c in self.children)


def flatten(obj: Any) -> tuple[list[torch.Tensor], Spec]:
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(obj, leaves)


def _flatten(obj: Any, leaves: list[torch.Tensor]) -> Spec:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return Spec("tensor", index=len(leaves) - 1)
    typ = type(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return Spec("namedtuple", typ, tuple(_flatten(v, leaves) for v in obj))
    if typ in (tuple, list):
        return Spec("seq", typ, tuple(_flatten(v, leaves) for v in obj))
    if typ is dict:
        keys = tuple(obj.keys())
        return Spec("dict", typ, tuple(_flatten(obj[k], leaves) for k in keys), keys)
    node = pytree.SUPPORTED_NODES.get(typ)
    if node is not None:
        values, context = node.flatten_fn(obj)
        return Spec("pytree", typ, tuple(_flatten(v, leaves) for v in values), context)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        template = copy.copy(obj)
        for n in names:  # drop tensor references held by the template
            object.__setattr__(template, n, None)
        return Spec(
            "dataclass", template, tuple(_flatten(getattr(obj, n), leaves) for n in names), names
        )
    if isinstance(obj, dict):  # OrderedDict and other dict subclasses
        keys = tuple(obj.keys())
        return Spec("dict", typ, tuple(_flatten(obj[k], leaves) for k in keys), keys)
    return Spec("const", context=obj)


def unflatten(spec: Spec, leaves: list[Any]) -> Any:
    if spec.kind == "tensor":
        return leaves[spec.index]
    if spec.kind == "const":
        return spec.context
    values = [unflatten(c, leaves) for c in spec.children]
    if spec.kind == "seq":
        return spec.type(values)
    if spec.kind == "namedtuple":
        return spec.type(*values)
    if spec.kind == "dict":
        return spec.type(zip(spec.context, values))
    if spec.kind == "pytree":
        return pytree.SUPPORTED_NODES[spec.type].unflatten_fn(values, spec.context)
    obj = copy.copy(spec.type)
    for name, v in zip(spec.context, values):
        object.__setattr__(obj, name, v)
    return obj
