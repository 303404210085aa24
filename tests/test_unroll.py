"""Pointwise kernels whose vector loop is short (lower/unroll.py): the loop unrolled into
the one around it, which becomes the vector loop; every result as eager's."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import opfuse
from opfuse.lower.unroll import SHORT
from tests.conftest import Fn, assert_matches_eager, assert_no_worse


def _compile(fn, *args):  # type: ignore[no-untyped-def]
    m = Fn(fn).eval()
    fast = opfuse.compile(m, args)
    assert_matches_eager(m, fast(*args), args)
    return fast


def _unrolled(fast) -> list[str]:  # type: ignore[no-untyped-def]
    return re.findall(r"(\w+ \(\d+\)) unrolled into", fast._first.compiled.source)


def _kernels(fast) -> list[str]:  # type: ignore[no-untyped-def]
    return re.findall(r"^int \w+\(.*?^}", fast._first.compiled.source, flags=re.S | re.M)


def test_an_rgb_image_copied_to_channels_last_runs_one_vector_loop_over_pixels() -> None:
    x = torch.randn(2, 3, 40, 56)
    fast = _compile(lambda x: x.contiguous(memory_format=torch.channels_last), x)
    assert fast(x).stride() == x.contiguous(memory_format=torch.channels_last).stride()
    assert _unrolled(fast) == ["x2 (3)"]
    (k,) = _kernels(fast)
    # the three channels' loads and stores in one vector loop over pixels (inside one over
    # images): no stack chunks, no 3-iteration inner loop
    assert k.count("for (") == 2 and "_c +=" not in k
    assert k.count("out0[") == 3


def _rope_pairs(x, cos, sin):  # type: ignore[no-untyped-def]
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x[..., 0], x[..., 1]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)


@pytest.mark.parametrize(
    ("f", "args"),
    [
        (lambda a, b: (a + b).sigmoid(), (torch.randn(300, 1), torch.randn(1, 3))),
        (lambda a: a.t().contiguous() + 1, (torch.randn(4, 333),)),
        (lambda a: a[:, 1:4].exp(), (torch.randn(257, 5),)),
        (lambda a, b: torch.stack([a * 2, b + 1], -1), (torch.randn(1001), torch.randn(1001))),
        (lambda a, b: torch.cat([a, b.relu()], -1) * 3, (torch.randn(99, 1), torch.randn(99, 3))),
        (_rope_pairs, (torch.randn(2, 3, 17, 16), torch.randn(17, 8), torch.randn(17, 8))),
        (
            lambda a, b: (a * b) // 2 + (a > 0),
            (torch.randint(-9, 9, (123, 4), dtype=torch.int32), torch.arange(4, dtype=torch.int32)),
        ),
        (lambda a: F.pad(a, (1, 1)) > 0.5, (torch.randn(77, 2),)),
    ],
    ids=["broadcast", "transpose", "slice", "stack", "cat", "rope", "int", "pad-bool"],
)
def test_short_vector_loops_are_unrolled_and_match_eager(f, args) -> None:  # type: ignore[no-untyped-def]
    fast = _compile(f, *args)
    assert _unrolled(fast), fast._first.compiled.source


def test_the_stack_of_pairs_decides_its_position_tests_per_copy() -> None:
    fast = _compile(
        lambda a, b: torch.stack([a * 2, b + 1], -1), torch.randn(1001), torch.randn(1001)
    )
    (k,) = _kernels(fast)
    # each unrolled store reads its own input: no select between the two
    assert " ? " not in k and "where" not in k


def test_long_vector_loops_are_kept() -> None:
    fast = _compile(lambda a: a.t().contiguous() * 2, torch.randn(40, SHORT))
    assert not _unrolled(fast)  # gcc keeps a group of 5 scalar: the loop stays
    fast = _compile(lambda a, b: a * b, torch.randn(64, 100), torch.randn(100))
    assert not _unrolled(fast)


def test_an_unrolled_kernel_serves_every_length_under_dynamic_shapes() -> None:
    torch._dynamo.reset()

    def f(a, b):  # type: ignore[no-untyped-def]
        return (a.unsqueeze(-1) * b + 1).relu()

    g = torch.compile(f, backend="opfuse", dynamic=True)
    b = torch.randn(3)
    for n in (5, 64, 1000, 7):
        a = torch.randn(n)
        torch.testing.assert_close(g(a, b), f(a, b))


def test_gradients_through_short_loops_match_eager() -> None:
    torch._dynamo.reset()

    def f(x, w):  # type: ignore[no-untyped-def]
        return (x[:, :3] * w).sigmoid().sum() + (x.t().contiguous() ** 2).mean()

    x, w = torch.randn(50, 4, requires_grad=True), torch.randn(3, requires_grad=True)
    f(x, w).backward()
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch.compile(f, backend="opfuse")(x, w).backward()
    torch.testing.assert_close((x.grad, w.grad), want)


@settings(max_examples=30, deadline=None)
@given(
    short=st.integers(1, SHORT + 1),
    rows=st.integers(1, 70),
    layout=st.sampled_from(["contiguous", "transposed", "sliced"]),
    op=st.sampled_from(["gelu", "mul", "where", "cast"]),
)
def test_random_short_last_dimensions_match_eager(
    short: int, rows: int, layout: str, op: str
) -> None:
    base = torch.randn(rows, short)
    if layout == "transposed":
        base = torch.randn(short, rows).t()
    elif layout == "sliced":
        base = torch.randn(rows, short + 3)[:, 2 : 2 + short]
    y = torch.randn(short)

    def f(a, b):  # type: ignore[no-untyped-def]
        if op == "gelu":
            return F.gelu(a) + b
        if op == "mul":
            return a * b, (a - b).abs()
        if op == "where":
            return torch.where(a > b, a, b * 2)
        return (a * 10).to(torch.int32) + 1

    _compile(f, base, y)


# -- rows of a few elements written out ----------------------------------------------------


def _written_out(fast) -> bool:  # type: ignore[no-untyped-def]
    return "written out" in fast._first.compiled.source


_W, _B = torch.rand(4), torch.randn(4)


def _nans_and_ties(n: int, s: int) -> torch.Tensor:
    x = torch.randn(n, s).round()  # many ties
    x[::7, s // 2] = float("nan")
    x[::11, 0] = float("nan")
    x[3::13] = float("-inf")
    return x


@pytest.mark.parametrize("s", [2, 3, 4])
@pytest.mark.parametrize(
    "f",
    [
        lambda x: x.softmax(-1),
        lambda x: x.log_softmax(-1) * 2,
        lambda x: F.layer_norm(x, x.shape[-1:], _W[: x.shape[-1]], _B[: x.shape[-1]]),
        lambda x: F.normalize(x, dim=-1),
        lambda x: (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True),
        lambda x: (x.softmax(-1), x.argmax(-1), x.argmin(-1)),
        lambda x: (x - x.amax(-1, keepdim=True), x.max(-1).indices, x.min(-1).values),
        lambda x: x / x.prod(-1, keepdim=True) + x.var(-1, correction=0, keepdim=True),
        lambda x: ((x > 0).any(-1, keepdim=True) & (x > 0)) | (x < -1).all(-1, keepdim=True),
    ],
    ids=[
        "softmax",
        "log_softmax",
        "layer_norm",
        "normalize",
        "std",
        "argmax",
        "max",
        "prod",
        "any",
    ],
)
def test_rows_of_a_few_elements_are_written_out_and_match_eager(f, s: int) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(203, s)
    fast = _compile(f, x)
    assert _written_out(fast), fast._first.compiled.source
    (k,) = _kernels(fast)
    assert "r0" not in k  # no loop over a row's elements


@pytest.mark.parametrize("s", [2, 3, 4])
def test_written_out_maxima_keep_nan_and_the_first_of_ties(s: int) -> None:
    x = _nans_and_ties(300, s)

    def f(x):  # type: ignore[no-untyped-def]
        return x.softmax(-1), x.argmax(-1), x.argmin(-1), x.amax(-1, keepdim=True) - x, x.max(-1)

    fast = _compile(f, x)
    assert _written_out(fast)


def test_integer_and_half_rows_written_out_match_eager() -> None:
    i = torch.randint(-5, 6, (111, 3), dtype=torch.int32)
    fast = _compile(lambda i: (i - i.amax(-1, keepdim=True), i.sum(-1), i.argmax(-1)), i)
    assert _written_out(fast)
    h = torch.randn(111, 4).half()
    fast = _compile(lambda h: (h.softmax(-1), F.layer_norm(h, (4,))), h)
    assert _written_out(fast)


@pytest.mark.parametrize(
    ("f", "x"),
    [
        (lambda x: x.softmax(1), torch.randn(2, 3, 9, 11)),
        (lambda x: x.norm(dim=-1), torch.randn(300, 3)),
        (lambda x: (x * 2).sum(-1), torch.randn(300, 4)),
        (lambda x: x.mean(1, keepdim=True) - x, torch.randn(2, 2, 9, 11)),
        (lambda x: F.adaptive_avg_pool2d(x, 1), torch.randn(4, 40, 2, 2)),
        (lambda x: F.max_pool2d(x, 2, padding=1, ceil_mode=True), torch.randn(2, 4, 9, 11)),
        (
            lambda x: F.avg_pool2d(x, 2, padding=1, count_include_pad=False),
            torch.randn(2, 4, 9, 11).contiguous(memory_format=torch.channels_last),
        ),
        (lambda x: x.argmax(-1), _nans_and_ties(200, 4)),
    ],
    ids=[
        "softmax-channels",
        "norm",
        "sum",
        "mean-channels",
        "global-pool",
        "max-pool",
        "avg-pool",
        "argmax",
    ],
)
def test_columns_of_a_few_elements_are_written_out_and_match_eager(f, x) -> None:  # type: ignore[no-untyped-def]
    fast = _compile(f, x)
    assert _written_out(fast), fast._first.compiled.source


def test_rows_of_five_keep_their_loops() -> None:
    fast = _compile(lambda x: x.softmax(-1), torch.randn(64, SHORT))
    assert not _written_out(fast)


def test_gradients_over_short_rows_match_eager() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    x0, w0 = torch.randn(77, 3), torch.randn(3)

    def f(x, w):  # type: ignore[no-untyped-def]
        y = F.layer_norm(x, (3,), w) + x.softmax(-1) * x.log_softmax(-1)
        return (y * torch.arange(3.0, dtype=x.dtype)).sum()

    def grads(fn, dtype):  # type: ignore[no-untyped-def]
        x = x0.to(dtype).clone().requires_grad_(True)
        w = w0.to(dtype).clone().requires_grad_(True)
        fn(x, w).backward()
        return x.grad, w.grad

    eager, ref = grads(f, torch.float32), grads(f, torch.float64)
    ours = grads(torch.compile(f, backend="opfuse"), torch.float32)
    for o, e, r, what in zip(ours, eager, ref, ("x", "w"), strict=True):
        # a LayerNorm's gradient over 3 elements cancels: the oracle rule, not eager's bits
        assert_no_worse(o, e, r, what)


def test_a_pass_reads_what_earlier_passes_stored_not_its_own_stores() -> None:
    # the max's backward mask compares the value the forward's last pass overwrites with
    # `t - max` in place: written out, the mask must read the value before the overwrite
    torch._dynamo.reset()

    def f(x):  # type: ignore[no-untyped-def]
        t = F.gelu(x)
        return t - t.amax(-1, keepdim=True)

    for shape in [(2,), (5, 3), (4, 1, 2)]:
        x = torch.randn(shape)
        w = torch.linspace(0.5, 1.5, x.numel()).view(shape)
        xe, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        (f(xe) * w).sum().backward()
        (torch.compile(f, backend="opfuse")(xo) * w).sum().backward()
        torch.testing.assert_close(xo.grad, xe.grad)


@settings(max_examples=30, deadline=None)
@given(
    s=st.integers(1, SHORT + 1),
    rows=st.integers(1, 90),
    transposed=st.booleans(),
    op=st.sampled_from(["softmax", "layer_norm", "argmax", "var", "sum"]),
)
def test_random_short_rows_match_eager(s: int, rows: int, transposed: bool, op: str) -> None:
    x = torch.randn(s, rows).t() if transposed else torch.randn(rows, s)

    def f(x):  # type: ignore[no-untyped-def]
        if op == "softmax":
            return x.softmax(-1)
        if op == "layer_norm":
            return F.layer_norm(x * 2, (s,))
        if op == "argmax":
            return x.exp() - x.amax(-1, keepdim=True), x.argmax(-1)
        if op == "var":
            return x - x.var(-1, keepdim=True, correction=min(1, s - 1))
        return x / (x.abs().sum(-1, keepdim=True) + 1)

    _compile(f, x)
