"""Elementwise fusion: structure (one kernel per DAG, views are not kernels) and numerics
with broadcasting, strided inputs, several outputs and every dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opfuse
from tests.conftest import Fn, assert_matches_eager


def compile_and_check(fn, *args):  # type: ignore[no-untyped-def]
    m = Fn(fn).eval()
    fast = opfuse.compile(m, args)
    assert_matches_eager(m, fast(*args), args)
    return fast.report


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32])
def test_chain_of_n_ops_is_one_kernel(n: int) -> None:
    ops = [
        torch.sin,
        lambda t: t * 1.5,
        torch.relu,
        lambda t: t + 0.25,
        torch.sigmoid,
        lambda t: t - 0.5,
        torch.tanh,
        torch.exp,
    ]

    def chain(x):  # type: ignore[no-untyped-def]
        for i in range(n):
            x = ops[i % len(ops)](x)
        return x

    r = compile_and_check(chain, torch.randn(33, 65))
    assert r.kernels_before == n
    assert r.kernels_after == 1
    assert [g.pattern for g in r.groups] == ["elementwise"]
    assert len(r.groups[0].ops) == n


def test_dag_with_shared_values_and_several_outputs_is_one_kernel() -> None:
    def f(x, y):  # type: ignore[no-untyped-def]
        a = x * y
        b = a.relu()
        c = a.sigmoid() * b  # a used twice: a diamond
        return c + x, b - y, c  # three outputs of the same shape

    r = compile_and_check(f, torch.randn(16, 40), torch.randn(16, 40))
    assert r.kernels_after == 1 and r.groups[0].pattern == "elementwise"


def test_sibling_ops_reading_one_input_share_a_kernel() -> None:
    r = compile_and_check(lambda x: (x.sin(), x.cos(), x.exp() * 2), torch.randn(1000))
    assert r.kernels_after == 1


def test_views_are_not_kernels() -> None:
    def f(x):  # type: ignore[no-untyped-def]
        y = (x * 2).view(4, 8, 8).permute(0, 2, 1)
        return (y + 1).reshape(4, 64).t().contiguous().sigmoid()

    r = compile_and_check(f, torch.randn(32, 8))
    assert r.kernels_after == 1
    assert all("view" not in op and "permute" not in op for g in r.groups for op in g.ops)


@pytest.mark.parametrize(
    "shapes",
    [
        [(4, 5, 6), (6,)],
        [(4, 5, 6), (5, 1)],
        [(4, 1, 6), (1, 5, 1)],
        [(3, 1), (1, 7)],
        [(8, 9), ()],
        [(2, 3, 4, 5), (3, 1, 1)],
    ],
)
def test_broadcasting(shapes: list[tuple[int, ...]]) -> None:
    args = [torch.randn(s) for s in shapes]
    r = compile_and_check(lambda a, b: (a * b + a).relu() - b * 0.5, *args)
    assert r.kernels_after == 1


def test_python_scalars_and_zero_dim_tensors() -> None:
    r = compile_and_check(lambda x, s: (x + s) * 3 - s / 2, torch.randn(10, 10), torch.tensor(2.5))
    assert r.kernels_after == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(30, 40).t(),  # transposed
        lambda: torch.randn(40, 61)[:, 3:33],  # sliced rows
        lambda: torch.randn(80, 30)[::2],  # stepped
        lambda: torch.randn(1, 30).expand(40, 30),  # expanded (stride 0)
        lambda: torch.randn(3, 40, 30)[1],  # offset view
        lambda: torch.randn(2, 30, 40).permute(0, 2, 1)[1],
    ],
)
def test_strided_inputs_read_in_place(make) -> None:  # type: ignore[no-untyped-def]
    x = make()
    y = torch.randn(40, 30)
    r = compile_and_check(lambda a, b: (a * 2 + b).tanh(), x, y)
    assert r.kernels_after == 1


def test_channels_last_layout_is_preserved() -> None:
    x = torch.randn(2, 8, 5, 7).to(memory_format=torch.channels_last)
    m = Fn(lambda a: (a + 1).relu()).eval()
    fast = opfuse.compile(m, (x,))
    out = fast(x)
    assert out.stride() == m(x).stride()
    assert_matches_eager(m, out, (x,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_float_dtypes(dtype: torch.dtype) -> None:
    x = torch.randn(64, 33).to(dtype)
    y = torch.randn(33).to(dtype)
    r = compile_and_check(lambda a, b: F.gelu(a * b + 1).sigmoid() * a, x, y)
    assert r.kernels_after == 1


def test_mixed_dtypes_promote_like_torch() -> None:
    x = torch.randn(20, 20)
    i = torch.randint(-5, 5, (20, 20))
    h = torch.randn(20).half()
    r = compile_and_check(lambda a, b, c: (a + b) * c + (b > 0), x, i, h)
    assert r.kernels_after == 1


def test_non_fusable_op_splits_the_chain() -> None:
    def f(x):  # type: ignore[no-untyped-def]
        y = (x * 2).relu()
        z = torch.cumsum(y, 1)  # no fused implementation: runs with torch
        return (z + 1).sigmoid()

    r = compile_and_check(f, torch.randn(8, 16))
    assert [g.pattern for g in r.groups] == ["elementwise", "fallback", "elementwise"]
    assert "cumsum" in r.groups[1].reason


def test_intermediates_not_materialised() -> None:
    r = compile_and_check(lambda x: ((x * 2) + 1).relu(), torch.randn(128, 128))
    g = r.groups[0]
    assert len(g.intermediates_saved) == 2  # mul and add results never reach memory
    assert g.bytes_saved == 2 * 2 * 128 * 128 * 4


@pytest.mark.parametrize("n, threaded", [(1000, False), (1 << 20, True)])
def test_small_kernels_stay_on_one_thread_and_vectorise(n: int, threaded: bool) -> None:
    # gcc does not vectorise a parallel loop whose if() clause is false, so a kernel too
    # small to share between threads must get a plain simd loop instead.
    x = torch.randn(n)
    fast = opfuse.compile(Fn(lambda a: torch.tanh(a * 2) + 1).eval(), (x,))
    assert_matches_eager(Fn(lambda a: torch.tanh(a * 2) + 1), fast(x), (x,))
    src = fast._first.compiled.source
    assert ("omp parallel" in src) == threaded
    assert "omp simd" in src or "parallel for simd" in src
