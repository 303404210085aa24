"""Give every node its Kind (ir.ops.Kind), refining the op table with the node's shapes:
a pointwise op that reads a broadcast operand is BROADCAST, and anything the generated
kernels cannot handle (dtype, device, empty tensors) is OPAQUE, with the reason kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ir.graph import CONSTANT, GETITEM, INPUT, Graph, Node, TensorMeta, device_type
from ..ir.ops import ATTENTION, SEED, Kind, info, torch_kernel_reason

SUPPORTED_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    }
)
ANCHOR_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})


@dataclass(frozen=True)
class Classified:
    kinds: dict[Node, Kind]
    why_opaque: dict[Node, str]  # ops the generated kernels do not cover, and why


def classify(graph: Graph, devices: tuple[str, ...] = ("cpu",)) -> Classified:
    """Each op's kind, and why it is OPAQUE; `devices`: the device types the backend's
    kernels run on (the C backend: the CPU)."""
    kinds: dict[Node, Kind] = {}
    why: dict[Node, str] = {}
    for n in graph.nodes:
        if n.op in (INPUT, CONSTANT):
            continue
        kind, reason = _kind(n, devices)
        kinds[n] = kind
        if reason:
            why[n] = reason
    return Classified(kinds, why)


def _tensor_metas(n: Node) -> list[TensorMeta]:
    out = [a.meta for a in n.inputs() if isinstance(a.meta, TensorMeta)]
    if isinstance(n.meta, TensorMeta):
        out.append(n.meta)
    elif isinstance(n.meta, tuple):
        out.extend(m for m in n.meta if isinstance(m, TensorMeta))
    return out


def _kind(n: Node, devices: tuple[str, ...]) -> tuple[Kind, str]:
    row = info(n.op)
    if n.op == ATTENTION:
        return Kind.OPAQUE, "the fused attention call reads it (a library call)"
    if n.op == SEED:
        return Kind.OPAQUE, "draws the seed of the kernels' random numbers from torch's generator"
    if row.kind == Kind.OPAQUE:
        return Kind.OPAQUE, torch_kernel_reason(n.op) or f"{n.op} has no fused implementation"
    if n.op == GETITEM:
        return Kind.INJECTIVE, ""
    metas = _tensor_metas(n)
    on = {m.device for m in metas}
    if len(on) > 1 or any(device_type(d) not in devices for d in on):
        return Kind.OPAQUE, f"tensors on {sorted(on)} (the backend's kernels run on {devices})"
    if row.kind == Kind.INJECTIVE:
        return Kind.INJECTIVE, ""
    if row.kind == Kind.ANCHOR:
        if any(m.dtype not in ANCHOR_DTYPES for m in metas):
            return Kind.OPAQUE, "matmul/conv on a non-float dtype"
        return Kind.ANCHOR, ""
    for m in metas:
        if m.dtype not in SUPPORTED_DTYPES:
            return Kind.OPAQUE, f"dtype {m.dtype} is not supported by generated kernels"
        if m.numel == 0:
            return Kind.OPAQUE, "empty tensor"
    if not isinstance(n.meta, TensorMeta) and row.kind != Kind.REDUCTION:
        return Kind.OPAQUE, "op returns several tensors"
    if row.kind == Kind.REDUCTION:
        return Kind.REDUCTION, ""
    out = n.tensor
    if any(a.meta.shape != out.shape for a in n.inputs() if isinstance(a.meta, TensorMeta)):
        return Kind.BROADCAST, ""
    return Kind.ELEMENTWISE, ""
