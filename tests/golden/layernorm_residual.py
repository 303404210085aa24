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


# fused_add_var_mean_rsqrt_sub_mul_0: aten.add.Tensor, aten.var_mean.correction, aten.add.Tensor, aten.rsqrt.default, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Tensor, aten.add.Tensor
# reads 24576 bytes, writes 12288 bytes
@triton.jit
def fused_add_var_mean_rsqrt_sub_mul_0_kernel(in0, in1, out0, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xl = tl.program_id(0).to(tl.int64) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xl < 32
    xzero = xl * 0
    x0 = xl
    acc0_lmean = tl.full([XBLOCK, RBLOCK], 0, tl.float64)
    acc0_lm2 = tl.full([XBLOCK, RBLOCK], 0, tl.float64)
    acc0_ln = tl.full([XBLOCK, RBLOCK], 0, tl.float64)
    for roff in range(0, 96, RBLOCK):
        rl = (roff + tl.arange(0, RBLOCK)[None, :]).to(tl.int64)
        rzero = xzero + rl * 0
        rmask = xmask & (rl < 96)
        r0 = rl
        t1 = tl.load(in0 + (rzero + r0 + 96 * x0), mask=rmask, other=0)
        t2 = tl.load(in1 + (rzero + r0 + 96 * x0), mask=rmask, other=0)
        t3 = (t1 + t2)
        t4 = t3.to(tl.float64)
        acc0_x = t4.to(tl.float64)
        acc0_nn = tl.where(rmask, acc0_ln + 1, acc0_ln)
        acc0_d = tl.where(rmask, acc0_x - acc0_lmean, 0)
        acc0_lmean = acc0_lmean + acc0_d / tl.where(acc0_nn == 0, 1, acc0_nn)
        acc0_lm2 = acc0_lm2 + acc0_d * tl.where(rmask, acc0_x - acc0_lmean, 0)
        acc0_ln = acc0_nn
    acc0_mean, acc0_m2, acc0_n = tl.reduce((acc0_lmean, acc0_lm2, acc0_ln), 1, combine_welford)
    acc0_mean = acc0_mean[:, None]
    acc0_m2 = acc0_m2[:, None]
    for roff in range(0, 96, RBLOCK):
        rl = (roff + tl.arange(0, RBLOCK)[None, :]).to(tl.int64)
        rzero = xzero + rl * 0
        rmask = xmask & (rl < 96)
        r0 = rl
        t5 = tl.load(in0 + (rzero + r0 + 96 * x0), mask=rmask, other=0)
        t6 = tl.load(in1 + (rzero + r0 + 96 * x0), mask=rmask, other=0)
        t7 = (t5 + t6)
        t8 = acc0_mean
        t9 = t8.to(tl.float32)
        t10 = (t7 - t9)
        t11 = acc0_m2
        t12 = tl.full(rzero.shape, 96.0, tl.float64)
        t13 = (t11 / t12)
        t14 = t13.to(tl.float32)
        t15 = tl.full(rzero.shape, 1e-05, tl.float32)
        t16 = (t14 + t15)
        t17 = (1.0 / libdevice.sqrt(t16))
        t18 = (t10 * t17)
        t19 = tl.full(rzero.shape, 1.5, tl.float32)
        t20 = (t18 * t19)
        t21 = tl.full(rzero.shape, 0.25, tl.float32)
        t22 = (t20 + t21)
        tl.store(out0 + (rzero + r0 + 96 * x0), t22, mask=rmask)


def fused_add_var_mean_rsqrt_sub_mul_0(args, nthreads=0):
    fused_add_var_mean_rsqrt_sub_mul_0_kernel[(4,)](*args, XBLOCK=8, RBLOCK=128, num_warps=4)
    return 0
