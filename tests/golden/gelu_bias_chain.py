import torch
import triton
import triton.language as tl
from opfuse.backends.triton.libdevice import libdevice

@triton.jit
def op_max(a, b):
    # torch.maximum / relu / clamp: NaN in either operand gives NaN
    return tl.where((a < b) | (b != b), b, a)


@triton.jit
def op_min(a, b):
    return tl.where((b < a) | (b != b), b, a)


@triton.jit
def op_remainder(a, b):
    # Python-style modulo: the result takes the divisor's sign
    m = libdevice.fmod(a, b)
    return tl.where((m != 0) & ((b < 0) != (m < 0)), m + b, m)


@triton.jit
def op_div_floor(a, b):
    # ATen's div_floor_floating
    m = libdevice.fmod(a, b)
    d = (a - m) / b
    d = tl.where((m != 0) & ((b < 0) != (m < 0)), d - 1, d)
    fl = libdevice.floor(d)
    fl = tl.where(d - fl > 0.5, fl + 1, fl)
    zero = libdevice.copysign(d * 0, a / b)
    return tl.where(b == 0, a / b, tl.where(d != 0, fl, zero))


@triton.jit
def op_div_floor_int(a, b):
    q = a // b
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)


@triton.jit
def op_fmod_int(a, b):
    return a % b


@triton.jit
def op_remainder_int(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def op_shr(a, b):
    # torch's >>: arithmetic on signed types; past the width, the sign fills
    bits: tl.constexpr = a.dtype.primitive_bitwidth
    big = (b < 0) | (b >= bits)
    fill = tl.where(a < 0, -1, 0).to(a.dtype)
    return tl.where(big, fill, a >> tl.where(big, 0, b).to(a.dtype))


@triton.jit
def op_shl(a, b):
    bits: tl.constexpr = a.dtype.primitive_bitwidth
    big = (b < 0) | (b >= bits)
    return tl.where(big, 0, a << tl.where(big, 0, b).to(a.dtype)).to(a.dtype)


@triton.jit
def op_pow_int(a, b):
    # torch's integer pow: wraps like repeated multiplication; a negative exponent gives
    # 1 for a == 1, +-1 for a == -1, 0 otherwise
    r = a * 0 + 1
    x = a
    e = tl.where(b < 0, 0, b)
    for _ in tl.static_range(63):
        r = tl.where((e & 1) != 0, r * x, r)
        x = x * x
        e = e >> 1
    neg = tl.where(a == 1, 1, tl.where(a == -1, tl.where((b % 2) == 0, 1, -1), 0))
    return tl.where(b < 0, neg.to(r.dtype), r)


@triton.jit
def op_mix64(seed, counter):
    # rewrite/random.py's SplitMix64 of (seed, counter), as the C prelude computes it
    z = seed.to(tl.uint64, bitcast=True) + (counter.to(tl.uint64, bitcast=True) + 1) * (
        0x9E3779B97F4A7C15
    )
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return (z ^ (z >> 31)).to(tl.int64, bitcast=True)


@triton.jit
def combine_sum(a, b):
    return a + b


@triton.jit
def combine_prod(a, b):
    return a * b


@triton.jit
def combine_or(a, b):
    return a | b


@triton.jit
def combine_and(a, b):
    return a & b


@triton.jit
def take_max(v, i, bv, bi):
    # argmax: does (v, i) replace (bv, bi)? NaN is the extreme value; ties go to the
    # lower index (torch's first occurrence)
    return tl.where(v != v, (bv == bv) | (i < bi),
                    tl.where(bv != bv, False, (v > bv) | ((v == bv) & (i < bi))))


@triton.jit
def take_min(v, i, bv, bi):
    return tl.where(v != v, (bv == bv) | (i < bi),
                    tl.where(bv != bv, False, (v < bv) | ((v == bv) & (i < bi))))


@triton.jit
def combine_argmax(bv, bi, v, i):
    t = take_max(v, i, bv, bi)
    return tl.where(t, v, bv), tl.where(t, i, bi)


@triton.jit
def combine_argmin(bv, bi, v, i):
    t = take_min(v, i, bv, bi)
    return tl.where(t, v, bv), tl.where(t, i, bi)


@triton.jit
def combine_welford(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    # Chan et al.; lanes that saw nothing (n == 0) merge as no-ops
    n = n_a + n_b
    w = tl.where(n == 0, 0.0, n_b / tl.where(n == 0, 1.0, n))
    d = mean_b - mean_a
    return mean_a + d * w, m2_a + m2_b + d * d * n_a * w, n


# fused_add_gelu_sigmoid_mul_sub_0: aten.add.Tensor, aten.gelu.default, aten.sigmoid.default, aten.mul.Tensor, aten.sub.Tensor
# reads 12672 bytes, writes 12288 bytes
@triton.jit
def fused_add_gelu_sigmoid_mul_sub_0_kernel(in0, in1, out0, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xl = tl.program_id(0).to(tl.int64) * XBLOCK + tl.arange(0, XBLOCK)
    xmask = xl < 3072
    xzero = xl * 0
    x1 = xl % 96
    x0 = (xl // 96)
    t1 = tl.load(in0 + (xzero + 96 * x0 + x1), mask=xmask, other=0)
    t2 = tl.load(in1 + (xzero + x1), mask=xmask, other=0)
    t3 = (t1 + t2)
    t4 = tl.full(xzero.shape, 0.5, tl.float32)
    t5 = (t3 * t4)
    t6 = tl.full(xzero.shape, 1.0, tl.float32)
    t7 = tl.full(xzero.shape, 0.7071067811865476, tl.float32)
    t8 = (t3 * t7)
    t9 = libdevice.erf(t8)
    t10 = (t6 + t9)
    t11 = (t5 * t10)
    t12 = (1.0 / (1.0 + libdevice.exp(-t1)))
    t13 = (t11 * t12)
    t14 = (t13 - t4)
    tl.store(out0 + (xzero + 96 * x0 + x1), t14, mask=xmask)


def fused_add_gelu_sigmoid_mul_sub_0(args, nthreads=0):
    fused_add_gelu_sigmoid_mul_sub_0_kernel[(3,)](*args, XBLOCK=1024, RBLOCK=1, num_warps=4)
    return 0
