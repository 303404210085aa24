"""The graph as text, one line per node:

    graph(%x: f32[32,96], %r: f32[32,96]):
      %w = constant : f32[96]
      %add = add.Tensor(%x, %r) : f32[32,96]                # layers.0
      %vm = var_mean.correction(%add, [1], correction=0, keepdim=True) : (f32[32,1], f32[32,1])
      return (%add,)

Strides are printed where they are not the contiguous ones (`f32[2,3,8,8]{192,1,24,3}`),
devices other than the CPU after an @.
"""

from __future__ import annotations

from typing import Any

import torch

from .graph import CONSTANT, INPUT, Graph, Node, TensorMeta, contiguous_strides

DTYPES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
}


def format_graph(graph: Graph) -> str:
    params = ", ".join(f"%{n.name}: {format_type(n.meta)}" for n in graph.inputs)
    lines = [f"graph({params}):"]
    for n in graph.nodes:
        if n.op != INPUT:
            lines.append("  " + format_node(n))
    outs = ", ".join(format_arg(o) for o in graph.outputs)
    lines.append(f"  return ({outs}{',' if len(graph.outputs) == 1 else ''})")
    return "\n".join(lines) + "\n"


def format_node(n: Node) -> str:
    if n.op == CONSTANT:
        text = f"%{n.name} = constant : {format_type(n.meta)}"
    else:
        args = [format_arg(a) for a in n.args] + [f"{k}={format_arg(v)}" for k, v in n.kwargs]
        op = n.op.removeprefix("aten.").removesuffix(".default")
        text = f"%{n.name} = {op}({', '.join(args)})"
        if n.meta is not None:
            text += f" : {format_type(n.meta)}"
    if n.source is not None and n.source.module:
        text = f"{text:<56}  # {n.source.module}"
    return text


def format_arg(a: Any) -> str:
    if isinstance(a, Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(format_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return DTYPES.get(a, str(a))
    return repr(a)


def format_type(meta: Any) -> str:
    if isinstance(meta, TensorMeta):
        text = f"{DTYPES.get(meta.dtype, str(meta.dtype))}[{','.join(map(str, meta.shape))}]"
        if meta.numel > 1 and meta.stride != contiguous_strides(meta.shape):
            text += "{" + ",".join(map(str, meta.stride)) + "}"
        if meta.device != "cpu":
            text += f"@{meta.device}"
        return text
    if isinstance(meta, tuple):
        return "(" + ", ".join(format_type(m) for m in meta) + ")"
    return "?" if meta is None else type(meta).__name__
