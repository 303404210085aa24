"""Flatten model inputs and outputs to lists of leaves and rebuild them.

Covers what models return: tensors, tuples, lists, dicts, namedtuples, dataclasses (frozen
ones too) and every type registered with torch's pytree (the ModelOutput classes of
popular model libraries register themselves). Non-tensor leaves are kept in the spec, so a
compiled model returns exactly the structure eager returns. The leaves' signature is what
a compile for them is kept under (opfuse.compile compiles again for another).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
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


def signature(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """What a compile for these input leaves assumes of them: each tensor's shape, strides,
    dtype and device (or which earlier leaf it is), each other value itself."""
    sig: list[Any] = []
    first: dict[int, int] = {}  # id of a tensor -> the leaf it first appeared as
    for k, v in enumerate(leaves):
        if isinstance(v, torch.Tensor):
            # torch.export traces a tensor passed twice as one input: that graph reads the
            # first leaf for both, and must not serve a call with two different tensors
            seen = first.setdefault(id(v), k)
            if seen != k:
                sig.append(("same tensor as input", seen))
                continue
            sig.append(("tensor", tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device)))
        else:
            try:
                hash(v)
                sig.append(("value", type(v), v))
            except TypeError:
                sig.append(("value", type(v), repr(v)))
    return tuple(sig)


def describe_mismatch(new: tuple[Any, ...], known: tuple[Any, ...]) -> str:
    """The first way signature `new` differs from `known`, for an error message."""
    if len(new) != len(known):
        return f"{len(new)} inputs, compiled for {len(known)}"
    for k, (a, b) in enumerate(zip(new, known)):
        if a == b:
            continue
        if a[0] == "tensor" and b[0] == "tensor":
            for what, i in (("shape", 1), ("strides", 2), ("dtype", 3), ("device", 4)):
                if a[i] != b[i]:
                    return f"input {k} has {what} {_fmt(a[i])}, compiled for {_fmt(b[i])}"
        if "same tensor as input" in (a[0], b[0]):
            return f"input {k} is {_which(a)}, compiled for {_which(b)}"
        return f"input {k} is {a[2]!r}, compiled for {b[2]!r}"
    return "inputs differ"


def _which(entry: tuple[Any, ...]) -> str:
    if entry[0] != "tensor":
        return f"the same tensor as input {entry[1]}"
    return "its own tensor"


def _fmt(v: Any) -> str:
    return str(list(v)) if isinstance(v, tuple) else str(v)
