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
from tests.conftest import Fn, assert_matches_eager


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
        (lambda a, b: torch.cat([a, b.relu()], -1) * 3, (torch.randn(99, 2), torch.randn(99, 3))),
        (_rope_pairs, (torch.randn(2, 3, 17, 16), torch.randn(17, 8), torch.randn(17, 8))),
        (
            lambda a, b: (a * b) // 2 + (a > 0),
            (torch.randint(-9, 9, (123, 6), dtype=torch.int32), torch.arange(6, dtype=torch.int32)),
        ),
        (lambda a: F.pad(a, (1, 1)) > 0.5, (torch.randn(77, 3),)),
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
    assert not _unrolled(fast)  # a vector of 8 is a vector
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
