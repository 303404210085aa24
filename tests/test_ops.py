"""Every pointwise op of the op table against eager, NaN/Inf/-0 included: one kernel each."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import opfuse
from tests.conftest import Fn, assert_matches_eager

aten = torch.ops.aten


def special(n: int = 256, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    vals = [
        math.nan,
        math.inf,
        -math.inf,
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        88.0,
        -88.0,
        1e30,
        -1e30,
        0.5,
        -0.5,
        2.5,
        -2.5,
        3.0,
        -3.0,
        1.0,
        -1.0,
        20.0,
        21.0,
    ]
    x[: len(vals)] = torch.tensor(vals)
    return x.to(dtype)


def positive(n: int = 256) -> torch.Tensor:
    return special(n).abs() + 0.1


UNARY = {
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "exp2": torch.exp2,
    "expm1": torch.expm1,
    "log": torch.log,
    "log1p": torch.log1p,
    "log2": torch.log2,
    "log10": torch.log10,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal,
    "sin": torch.sin,
    "cos": torch.cos,
    "tan": torch.tan,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "erf": torch.erf,
    "erfc": torch.erfc,
    "asin": torch.asin,
    "acos": torch.acos,
    "atan": torch.atan,
    "sinh": torch.sinh,
    "cosh": torch.cosh,
    "asinh": torch.asinh,
    "acosh": torch.acosh,
    "atanh": torch.atanh,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "hardtanh": F.hardtanh,
    "relu6": F.relu6,
    "clamp": lambda x: x.clamp(-1.5, 2.0),
    "clamp_min": lambda x: x.clamp(min=0.25),
    "clamp_max": lambda x: x.clamp(max=0.25),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "elu": F.elu,
    "selu": F.selu,
    "celu": lambda x: F.celu(x, 0.7),
    "softplus": F.softplus,
    "softplus_beta": lambda x: F.softplus(x, beta=2, threshold=5),
    "mish": F.mish,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "round": torch.round,
    "trunc": torch.trunc,
    "sign": torch.sign,
    "frac": torch.frac,
    "isnan": torch.isnan,
    "isinf": torch.isinf,
    "isfinite": torch.isfinite,
    "signbit": torch.signbit,
    "square": torch.square,
    "pow2": lambda x: x**2,
    "pow3": lambda x: x**3,
    "pow_half": lambda x: x**0.5,
    "pow_m1": lambda x: x**-1,
    "pow_m2": lambda x: x**-2,
    "pow_1_7": lambda x: x**1.7,
    "rpow": lambda x: 2.0**x,
    "nan_to_num": torch.nan_to_num,
    "logical_not": torch.logical_not,
    "to_half": lambda x: x.half(),
    "to_bf16": lambda x: x.bfloat16(),
    "to_double": lambda x: x.double(),
    "to_int": lambda x: x.clamp(-1000, 1000).int(),
    "to_bool": lambda x: x.bool(),
    "masked_fill": lambda x: x.masked_fill(x > 1, -7.0),
    "where_scalar": lambda x: torch.where(x > 0, x, 0.0),
    "threshold": lambda x: F.threshold(x, 0.5, -1.0),
}

BINARY = {
    "add": torch.add,
    "add_alpha": lambda a, b: torch.add(a, b, alpha=2.5),
    "sub": torch.sub,
    "rsub": lambda a, b: torch.rsub(a, b, alpha=0.5),
    "mul": torch.mul,
    "div": torch.div,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "floor_divide": torch.floor_divide,
    "fmod": torch.fmod,
    "remainder": torch.remainder,
    "pow": torch.pow,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "fmax": torch.fmax,
    "fmin": torch.fmin,
    "atan2": torch.atan2,
    "hypot": torch.hypot,
    "copysign": torch.copysign,
    "eq": torch.eq,
    "ne": torch.ne,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "logical_and": torch.logical_and,
    "logical_or": torch.logical_or,
    "logical_xor": torch.logical_xor,
    "where": lambda a, b: torch.where(a > b, a, b),
    "lerp": lambda a, b: torch.lerp(a, b, 0.3),
    "lerp_t": lambda a, b: torch.lerp(a, b, b.sigmoid()),
    "addcmul": lambda a, b: torch.addcmul(a, a, b, value=0.5),
    "addcdiv": lambda a, b: torch.addcdiv(a, a, b.abs() + 1, value=-2.0),
    "threshold_backward": lambda a, b: aten.threshold_backward(a, b, 0.0),
    "sigmoid_backward": lambda a, b: aten.sigmoid_backward(a, b.sigmoid()),
    "tanh_backward": lambda a, b: aten.tanh_backward(a, b.tanh()),
    "gelu_backward": lambda a, b: aten.gelu_backward(a, b),
    "gelu_backward_tanh": lambda a, b: aten.gelu_backward(a, b, approximate="tanh"),
    "silu_backward": lambda a, b: aten.silu_backward(a, b),
    "hardswish_backward": lambda a, b: aten.hardswish_backward(a, b),
    "hardsigmoid_backward": lambda a, b: aten.hardsigmoid_backward(a, b),
    "hardtanh_backward": lambda a, b: aten.hardtanh_backward(a, b, -1.0, 1.0),
    "leaky_relu_backward": lambda a, b: aten.leaky_relu_backward(a, b, 0.1, False),
    "elu_backward": lambda a, b: aten.elu_backward(a, 1.0, 1.0, 1.0, False, b),
    "softplus_backward": lambda a, b: aten.softplus_backward(a, b, 1.0, 20.0),
}


def _kernels(fast: torch.nn.Module) -> dict[str, int]:
    return fast.report.patterns()  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name: str) -> None:
    fn = UNARY[name]
    x = special()
    m = Fn(lambda a: fn(a * 1.0)).eval()  # the mul keeps even a lone cast in a fused kernel
    fast = opfuse.compile(m, (x,))
    assert _kernels(fast) == {"elementwise": 1}, fast.report
    assert_matches_eager(m, fast(x), (x,))


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary(name: str) -> None:
    fn = BINARY[name]
    a, b = special(), special(seed=1).flip(0)
    b[::7] = 0.0  # division by zero, both signs of zero numerators
    m = Fn(lambda x, y: fn(x * 1.0, y)).eval()
    fast = opfuse.compile(m, (a, b))
    assert _kernels(fast) == {"elementwise": 1}, fast.report
    assert_matches_eager(m, fast(a, b), (a, b))


ROUNDED_ONCE = {
    "add_alpha": lambda a, b: torch.add(a, b, alpha=2.0),
    "sub_alpha": lambda a, b: torch.sub(a, b, alpha=2.0),
    "rsub_alpha": lambda a, b: torch.rsub(a, b, alpha=2.0),
    "lerp_small": lambda a, b: torch.lerp(a, b, 0.3),
    "lerp_large": lambda a, b: torch.lerp(a, b, 0.7),
    "lerp_tensor": lambda a, b: torch.lerp(a, b, torch.full_like(a, 0.3)),
    "addcdiv": lambda a, b: torch.addcdiv(a, a, b, value=0.5),
}


@pytest.mark.parametrize("name", sorted(ROUNDED_ONCE))
def test_rounded_once_as_eager(name: str) -> None:
    # Where eager's kernels round a product and a sum once (a fused multiply-add) or divide
    # value * tensor1, two roundings differ in the last bit or overflow: 2 * 3.4e38 is inf
    # in float32 where 3.4e38 - 2 * 3.4e38 is not. 64 elements: eager's vector path.
    pairs = [(3.4e38, 3.4e38), (-3.4e38, 3.4e38), (3.4e38, -0.5), (1.0, -1.5), (1.0, -2.5)]
    pairs += [(-1.0, 1.5), (0.1, 0.7), (1e-45, 0.0)]
    a = torch.tensor([p[0] for p in pairs] * 8)
    b = torch.tensor([p[1] for p in pairs] * 8)
    fn = ROUNDED_ONCE[name]
    m = Fn(lambda x, y: fn(x * 1.0, y * 1.0)).eval()
    fast = opfuse.compile(m, (a, b))
    assert _kernels(fast) == {"elementwise": 1}, fast.report
    torch.testing.assert_close(fast(a, b), m(a, b), rtol=0, atol=0, equal_nan=True)


INT_BINARY = [
    "add",
    "sub",
    "mul",
    "div",
    "div_trunc",
    "div_floor",
    "fmod",
    "remainder",
    "maximum",
    "minimum",
    "eq",
    "lt",
    "where",
    "logical_and",
]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8])
@pytest.mark.parametrize("name", INT_BINARY)
def test_integer(name: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    lo = 0 if dtype == torch.uint8 else -100
    a = torch.randint(lo, 100, (300,), generator=g, dtype=dtype)
    b = torch.randint(1 if dtype == torch.uint8 else lo, 100, (300,), generator=g, dtype=dtype)
    b[b == 0] = 3
    m = Fn(lambda x, y: BINARY[name](x * 1, y)).eval()
    fast = opfuse.compile(m, (a, b))
    assert_matches_eager(m, fast(a, b), (a, b))


def test_integer_division_by_zero_raises_like_torch() -> None:
    a = torch.tensor([5, 7, -9])
    b = torch.tensor([2, 0, 3])
    m = Fn(lambda x, y: (x + 1) // y).eval()
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        m(a, b)
    fast = opfuse.compile(m, (a, torch.tensor([2, 1, 3])))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fast(a, b)


_W16 = torch.randn(16, 16, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    ("fn", "pattern"),
    [
        (lambda x, y: (x // y).amax(1), "fallback"),  # a reduction over rows
        (lambda x, y: (x // y).sum(0), "fallback"),  # over columns
        (lambda x, y: torch.remainder(x, y).sum(1), "fallback"),
        (lambda x, y: (x.sum(1, keepdim=True) // y).amax(1), "fallback"),
        # a matmul's epilogue (the tiles' epilogue checks nothing: it runs unfused)
        (lambda x, y: ((x.float() @ _W16).long() // y).float() + 1, "gemm_epilogue"),
    ],
    ids=["amax-rows", "sum-columns", "remainder-sum", "sum-div-amax", "gemm-epilogue"],
)
def test_integer_division_by_zero_raises_in_reductions_and_epilogues(fn, pattern) -> None:  # type: ignore[no-untyped-def]
    # These computed x // 0 without a word (a reduction's or a tile epilogue's kernel
    # tests no divisor); such a group now runs where it is checked.
    g = torch.Generator().manual_seed(2)
    a = torch.randint(1, 9, (8, 16), generator=g)
    b = torch.randint(1, 5, (8, 16), generator=g)
    zero = b.clone()
    zero[3, 5] = 0
    m = Fn(fn).eval()
    fast = opfuse.compile(m, (a, b))
    assert_matches_eager(m, fast(a, b), (a, b))
    assert pattern in {g.pattern.value for g in fast.report.groups}
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        m(a, zero)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fast(a, zero)


def test_integer_overflow_wraps_like_torch() -> None:
    a = torch.tensor([2**62, -(2**63), 2**31], dtype=torch.int64)
    m = Fn(lambda x: (x * 4 - 1) // -1).eval()
    fast = opfuse.compile(m, (a,))
    assert torch.equal(fast(a), m(a))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["add", "mul", "div", "maximum", "pow", "where", "remainder"])
def test_float_dtypes_binary(name: str, dtype: torch.dtype) -> None:
    a, b = special(dtype=dtype), special(dtype=dtype, seed=1).flip(0)
    m = Fn(lambda x, y: BINARY[name](x * 1, y)).eval()
    fast = opfuse.compile(m, (a, b))
    assert_matches_eager(m, fast(a, b), (a, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "name", ["exp", "gelu", "silu", "tanh", "sigmoid", "round", "to_int", "isnan"]
)
def test_float_dtypes_unary(name: str, dtype: torch.dtype) -> None:
    x = special(dtype=dtype)
    m = Fn(lambda a: UNARY[name](a * 1)).eval()
    fast = opfuse.compile(m, (x,))
    assert_matches_eager(m, fast(x), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decimals", [-2, -1, 1, 3])
def test_round_to_decimals_fuses_and_matches_eager_bit_for_bit(
    decimals: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=g) * 10.0 ** torch.randint(-3, 6, (4000,), generator=g)
    x = torch.cat([x, torch.tensor([0.125, 0.135, 2.5, -2.5, 1.005, -0.0, math.inf, math.nan])])
    x = x.to(dtype)
    m = Fn(lambda a: torch.round(a, decimals=decimals)).eval()
    fast = opfuse.compile(m, (x,))
    assert _kernels(fast) == {"elementwise": 1}, fast.report
    torch.testing.assert_close(fast(x), m(x), rtol=0, atol=0, equal_nan=True)


def test_bool_ops() -> None:
    a = torch.rand(100) > 0.5
    b = torch.rand(100) > 0.5
    m = Fn(lambda x, y: ((x & y) | ~x) ^ (x == y)).eval()
    fast = opfuse.compile(m, (a, b))
    assert torch.equal(fast(a, b), m(a, b))
    assert _kernels(fast) == {"elementwise": 1}
