"""Attention written as matmul -> scale -> mask -> softmax -> matmul runs as one fused call
(rewrite/attention.py) when the scores are large; eager's results, NaN rows included."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.bench.models import GPT2Block
from opfuse.frontend import dynamo
from opfuse.ir.attention import layout, run_attention, strides
from opfuse.rewrite.attention import MAX_WRITTEN, MIN_SCORES
from opfuse.runtime.execute import TorchStep
from tests.conftest import Fn, assert_matches_eager

S = 256  # 256x256 scores per head: at MIN_SCORES, so the rewrite applies


def _qkv(b: int = 2, h: int = 2, s: int = S, d: int = 16, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, h, s, d, generator=g).to(dtype) for _ in range(3))


def _attention(mask_kind: str, scale_kind: str = "mul") -> Any:
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)

    def scaled(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        s = q @ k.transpose(-1, -2)
        return s * 0.25 if scale_kind == "mul" else s / math.sqrt(q.shape[-1])

    def f(q, k, v, m=None):  # type: ignore[no-untyped-def]
        s = scaled(q, k)
        if mask_kind == "causal":
            s = s.masked_fill(causal, float("-inf"))
        elif mask_kind == "causal_finfo_min":
            s = torch.where(causal, torch.finfo(s.dtype).min, s)
        elif mask_kind == "keep_finfo_min":  # as Hugging Face's GPT-2 writes it
            s = torch.where(~causal, s, torch.full([], torch.finfo(s.dtype).min))
        elif mask_kind == "keep_input":
            s = torch.where(m, s, float("-inf"))
        elif mask_kind == "additive":
            s = s + m
        elif mask_kind == "bool_input":
            s = s.masked_fill(m, float("-inf"))
        return s.softmax(-1) @ v

    return f


def _compile(fn: Any, args: tuple[Any, ...]) -> tuple[nn.Module, Any]:
    m = Fn(fn).eval()
    return m, opfuse.compile(m, args)


@pytest.mark.parametrize(
    "mask_kind",
    [
        "none",
        "causal",
        "causal_finfo_min",
        "keep_finfo_min",
        "additive",
        "bool_input",
        "keep_input",
    ],
)
@pytest.mark.parametrize("scale_kind", ["mul", "div"])
def test_attention_runs_as_one_fused_call(mask_kind: str, scale_kind: str) -> None:
    q, k, v = _qkv()
    args: tuple[Any, ...] = (q, k, v)
    if mask_kind == "additive":  # BERT's padding mask, broadcast over heads and queries
        args += ((torch.rand(2, 1, 1, S) < 0.2).float() * -10000.0,)
    elif mask_kind == "bool_input":
        args += (torch.rand(2, 1, S, S) < 0.3,)
    elif mask_kind == "keep_input":  # (row 5 of batch 0 keeps nothing: NaN, as in eager)
        keep = torch.rand(2, 1, S, S) > 0.3
        keep[0, 0, 5] = False
        args += (keep,)
    m, fast = _compile(_attention(mask_kind, scale_kind), args)
    assert_matches_eager(m, fast(*args), args)
    r = fast.report
    assert r.patterns().get("attention") == 1, str(r)
    assert "softmax" not in str([g.ops for g in r.groups])
    assert not any("amax" in op for g in r.groups for op in g.ops)  # no explicit softmax left
    assert len(r.attention) == 1 and "one fused attention call" in r.attention[0]


def test_fully_masked_rows_are_nan_as_in_eager() -> None:
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, S, S)
    mask[0, 0, 3, :] = float("-inf")  # query 3 of batch 0 sees nothing: 0/0 in eager
    mask[1, 0, :, 5] = float("-inf")  # one key masked everywhere: ordinary rows
    m, fast = _compile(_attention("additive"), (q, k, v, mask))
    assert fast.report.patterns().get("attention") == 1
    got, ref = fast(q, k, v, mask), m(q, k, v, mask)
    assert ref[0, :, 3].isnan().all() and got[0, :, 3].isnan().all()
    torch.testing.assert_close(got, ref, equal_nan=True)


def test_nan_inputs_propagate_as_in_eager() -> None:
    q, k, v = _qkv()
    q[1, 0, 7, 2] = float("nan")
    v[0, 1, 9, 0] = float("inf")
    m, fast = _compile(_attention("causal"), (q, k, v))
    got, ref = fast(q, k, v), m(q, k, v)
    assert torch.equal(got.isnan(), ref.isnan())
    torch.testing.assert_close(got, ref, equal_nan=True)


def test_finite_fill_with_a_fully_masked_constant_row_stays_explicit() -> None:
    # where(mask, finfo.min, s) on a row that masks everything is a uniform row in eager
    # (all scores equal), not NaN: the fused call cannot give it, so nothing is rewritten
    mask = torch.zeros(S, S, dtype=torch.bool)
    mask[4, :] = True
    q, k, v = _qkv()
    m, fast = _compile(
        lambda q, k, v: (
            torch.where(mask, -3.0e38, (q @ k.transpose(-1, -2)) * 0.25).softmax(-1) @ v
        ),
        (q, k, v),
    )
    assert "attention" not in fast.report.patterns()
    assert_matches_eager(m, fast(q, k, v), (q, k, v))


def test_probabilities_used_elsewhere_stay_explicit() -> None:
    q, k, v = _qkv()

    def f(q, k, v):  # type: ignore[no-untyped-def]
        p = ((q @ k.transpose(-1, -2)) * 0.25).softmax(-1)
        return p @ v, p.sum(-2)  # the probabilities themselves are needed

    m, fast = _compile(f, (q, k, v))
    assert "attention" not in fast.report.patterns()
    assert_matches_eager(m, fast(q, k, v), (q, k, v))


def test_short_sequences_stay_explicit_and_say_why() -> None:
    q, k, v = _qkv(s=64)
    m, fast = _compile(_attention("none"), (q, k, v))
    assert "attention" not in fast.report.patterns()
    (note,) = fast.report.attention
    assert "kept as matmul, softmax, matmul" in note and str(MIN_SCORES) in note
    assert_matches_eager(m, fast(q, k, v), (q, k, v))


def _symbolic_lengths(lengths: tuple[int, ...]) -> tuple[list[Any], int]:
    """Masked attention (a row fully masked: NaN, as in eager) under dynamic=True over
    `lengths`: each compile's report, and how many compiles."""
    g = torch.Generator().manual_seed(0)

    def f(q, k, v, m):  # type: ignore[no-untyped-def]
        return ((q @ k.transpose(-1, -2)) * 0.25 + m).softmax(-1) @ v

    m = Fn(f).eval()
    torch._dynamo.reset()
    fast = torch.compile(m, backend="opfuse", dynamic=True)
    before = dynamo.compiles()
    with torch.no_grad(), dynamo.listening() as reports:
        for s in lengths:
            # (no two sizes equal: dynamo would give them one symbol, and recompile)
            q, k, v = (torch.randn(3, 2, s, 8, generator=g) for _ in range(3))
            drop = torch.rand(3, 1, 1, s, generator=g) < 0.2
            mask = torch.zeros(3, 1, 1, s).masked_fill(drop, -math.inf)
            mask[0, ..., :] = -math.inf
            assert_matches_eager(m, fast(q, k, v, mask), (q, k, v, mask))
    torch._dynamo.reset()
    compiled = [r for r in reports if r.patterns() and not any("served by" in d for d in r.dynamic)]
    return compiled, dynamo.compiles() - before


def test_a_symbolic_length_writes_the_attention_out_up_to_512_tokens() -> None:
    """With the length a symbol, the attention written out serves 16 to 512 tokens (up
    to MAX_WRITTEN scores per head) in one compile, short and long; 600 compiles again
    with the fused call, which serves the longer lengths."""
    compiled, compiles = _symbolic_lengths((16, 300, 40, 512, 600, 24, 1000))
    assert compiles == 2  # (1000 served by 600's compile: the fused call's new nodes'
    # sizes, found by trial runs of their meta functions, tested again there)
    assert [r.patterns().get("attention") for r in compiled] == [None, 1]
    assert f"pays from {MAX_WRITTEN + 1} scores with the length varying" in compiled[0].attention[0]


@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="bfloat16 attention needs oneDNN"
)
def test_bfloat16_attention_with_float32_softmax() -> None:
    q, k, v = _qkv(dtype=torch.bfloat16)
    f = lambda q, k, v: ((q @ k.transpose(-1, -2)) * 0.25).float().softmax(-1).to(q.dtype) @ v
    m, fast = _compile(f, (q, k, v))
    assert fast.report.patterns().get("attention") == 1, str(fast.report)
    assert_matches_eager(m, fast(q, k, v), (q, k, v))


def test_transformer_block_never_stores_the_scores() -> None:
    # GPT-2 block at 512 tokens: the 12x512x512 scores (12 MiB) would be the largest
    # intermediate; with the fused call no pooled block or fresh tensor is that large
    torch.manual_seed(0)
    block = GPT2Block().eval()
    x = torch.randn(1, 512, 768)
    fast = opfuse.compile(block, (x,))
    assert fast.report.patterns().get("attention") == 1
    with torch.no_grad():
        assert_matches_eager(block, fast(x), (x,))
    plan = fast._first.compiled.run.plan
    scores = 12 * 512 * 512 * 4
    assert max(plan.pool_sizes, default=0) < scores
    off = opfuse.compile(block, (x,), options=opfuse.Options(fuse_attention=False))
    assert max(off._first.compiled.run.plan.pool_sizes) >= scores  # (what it saves)
    # the plan runs the call's body, not the custom op through torch's dispatcher
    calls = [s for s in plan.steps if isinstance(s, TorchStep) and s.fn is run_attention]
    assert len(calls) == 1


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 12, 1, 64), (2, 0, 3, 4), (3, 5, 7)])
def test_the_layout_strides_are_those_of_the_layout_made(shape: tuple[int, ...]) -> None:
    q = torch.empty(shape)
    assert strides(torch.Size(shape)) == layout(q, q).stride()
