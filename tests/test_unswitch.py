"""Kernels cut into cases along an outer variable (lower/unswitch.py) and constant masks
read as position tests (lower/constants.py): each case reads only the inputs its range needs,
and every case together computes what eager does."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import opfuse
from opfuse.lower.constants import interval
from tests.conftest import Fn, assert_matches_eager


def _compile(fn, *args):  # type: ignore[no-untyped-def]
    m = Fn(fn).eval()
    fast = opfuse.compile(m, args)
    assert_matches_eager(m, fast(*args), args)
    return fast


def _kernel_sources(src: str) -> list[str]:
    return re.findall(r"^int \w+\(.*?^}", src, flags=re.S | re.M)


def _case_loads(src: str) -> list[set[str]]:
    """The inputs each case of the one kernel in `src` loads (one set: run whole)."""
    (k,) = _kernel_sources(src)
    body = k.split("(void)nthreads;", 1)[1]
    parts = re.split(r"^  \{$", body, flags=re.M)[1:] or [body]
    return [set(re.findall(r"= (in\d+)\[", p)) for p in parts]


def _cases(src: str) -> int:
    return len(_case_loads(src))


def test_interval_masks_are_recognised() -> None:
    a = torch.arange(6).view(1, 6, 1)
    assert interval((a == 2).expand(3, 6, 4)) == (1, 2, 3)
    assert interval((a >= 1) & (a < 4)) == (1, 1, 4)
    assert interval(a < 9) == (-1, 0, 1)  # all true
    assert interval(a < 0) == (-1, 0, 0)  # all false
    assert interval(a % 2 == 0) is None  # two runs
    assert interval(torch.ones(4, 4, dtype=torch.bool).triu()) is None  # varies along two
    assert interval(a.float()) is None  # not a mask


def _stacked_grads(q, k, v):  # type: ignore[no-untyped-def]
    # what autograd writes for the gradient of `q, k, v = qkv.unbind(0)`: a where per
    # select on a constant mask, summed, then laid out as the projection's [B*S, 3*H*D]
    # gradient and its column sum (the bias gradient)
    idx = torch.arange(3).view(3, 1, 1, 1, 1)
    z = 0.0
    g = (
        torch.where(idx == 2, v.unsqueeze(0), z)
        + torch.where(idx == 1, k.transpose(-1, -2).unsqueeze(0), z)
        + torch.where(idx == 0, q.unsqueeze(0), z)
    )
    g = g.permute(1, 3, 0, 2, 4).reshape(q.shape[0] * q.shape[2], -1)
    return g, g.sum(0)


def test_stacked_gradients_read_each_input_once() -> None:
    q, v = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 16, 8)
    k = torch.randn(2, 3, 8, 16)
    fast = _compile(_stacked_grads, q, k, v)
    assert fast.report.kernels_after == 1
    assert fast.report.groups[0].pattern == "reduction"
    src = fast._first.compiled.source
    # each case loads one of the three gradients, none loads a mask
    assert sorted(map(sorted, _case_loads(src))) == [["in0"], ["in1"], ["in2"]]
    assert "uint8_t" not in _kernel_sources(src)[0]
    assert "as 3 cases of x0 = 1 + 1 + 1" in src  # the kernel's header says how it runs


def test_unbind_gradient_under_training() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 48)

    def attn(x):  # type: ignore[no-untyped-def]
        q, k, v = lin(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return ((q @ k.transpose(-1, -2)).softmax(-1) @ v).sum()

    x = torch.randn(2, 8, 16)
    attn(x).backward()
    want = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    torch._dynamo.reset()
    torch.compile(attn, backend="opfuse")(x).backward()
    for p, w in zip(lin.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "f",
    [
        lambda a, b, c: torch.cat([a, b.exp(), c], 1).sum((0, 2, 3)),  # columns
        lambda a, b, c: F.layer_norm(torch.cat([a, b, c * 2], 1), (5, 7)),  # rows
        lambda a, b, c: torch.cat([a, b, c], 1).relu() * 3,  # pointwise
        lambda a, b, c: F.pad(a, (0, 0, 0, 0, 2, 3), value=0.5).amax((2, 3)),
    ],
)
def test_a_cat_along_an_outer_dimension_reads_each_input_in_its_own_case(f) -> None:  # type: ignore[no-untyped-def]
    args = (torch.randn(2, 6, 5, 7), torch.randn(2, 3, 5, 7), torch.randn(2, 4, 5, 7))
    fast = _compile(f, *args)
    assert fast.report.kernels_after == 1
    src = fast._first.compiled.source
    loads = _case_loads(src)
    assert len(loads) >= 3 and all(len(x) <= 1 for x in loads)  # one input read per case


def test_a_test_that_drops_no_load_leaves_the_kernel_whole() -> None:
    # both branches read x: cases would only repeat the loop nest
    mask = torch.arange(6).view(1, 6, 1) < 3
    fast = _compile(lambda x: torch.where(mask, x, x * 2).sum(-1), torch.randn(4, 6, 9))
    assert _cases(fast._first.compiled.source) == 1


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    dim=st.integers(0, 2),
    reduce=st.sampled_from([None, -1, 0, (0, 2)]),
)
def test_random_cats_match_eager(sizes: list[int], dim: int, reduce) -> None:  # type: ignore[no-untyped-def]
    shape = [3, 4, 6]
    args = []
    for s in sizes:
        sh = list(shape)
        sh[dim] = s
        args.append(torch.randn(*sh))

    def f(*xs):  # type: ignore[no-untyped-def]
        y = torch.cat([x.sin() for x in xs], dim)
        return y * 2 if reduce is None else y.sum(reduce)

    _compile(f, *args)
