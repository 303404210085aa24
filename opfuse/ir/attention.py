"""The fused attention op the attention rewrite (rewrite/attention.py) puts in graphs:
`opfuse::attention`, softmax(scale * Q @ K^T + mask) @ V as torch's scaled-dot-product
attention, with eager's result on fully masked rows, and the layout of its output. Its
own module, below the rewrite that makes it and the plan that calls its body
(runtime/plan.DIRECT)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .graph import contiguous_strides


def run_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """softmax(q @ k^T * scale + mask) @ v with eager's result on fully masked rows (NaN),
    laid out as `layout` says. The plan calls it directly (runtime/plan.DIRECT): through
    torch's dispatcher, the custom op below costs ~45 us more a call (BERT-base at 16
    tokens: 0.1 ms a layer)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask is not None:
        dead = torch.isneginf(mask).all(-1, keepdim=True)
        if bool(dead.any()):
            out = out.masked_fill(dead, math.nan)
    if out.stride() != strides(out.shape):  # torch chose another kernel: keep the layout
        out = layout(q, v).copy_(out)
    return out


@torch.library.custom_op("opfuse::attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """softmax(q @ k^T * scale + mask) @ v with eager's result on fully masked rows (NaN)."""
    return run_attention(q, k, v, mask, scale)


@attention.register_fake
def _fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return layout(q, v)


def layout(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output as the CPU flash kernel lays it out: [B, S, H, D] memory for a 4-D
    [B, H, S, D] result, so that the usual transpose(1, 2).reshape(B, S, H*D) is a view."""
    shape = (*q.shape[:-1], v.shape[-1])
    if len(shape) != 4:
        return q.new_empty(shape)
    b, h, s, d = shape
    return q.new_empty((b, s, h, d)).transpose(1, 2)


def strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of `layout`'s tensor of this shape, without making it."""
    if len(shape) != 4:
        return contiguous_strides(shape)
    b, s, h, d = contiguous_strides((shape[0], shape[2], shape[1], shape[3]))  # [B, S, H, D]
    return (b, h, s, d)
