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


# fused_clone_amax_sub_exp_sum_and_1_more_0: aten.clone.default, aten.amax.default, aten.sub.Tensor, aten.exp.default, aten.sum.dim_IntList, aten.div.Tensor
# reads 2400 bytes, writes 2400 bytes
@triton.jit
def fused_clone_amax_sub_exp_sum_and_1_more_0_kernel(in0, out0, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xl = tl.program_id(0).to(tl.int64) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xl < 12
    xzero = xl * 0
    x0 = xl
    acc0_lvalue = tl.full([XBLOCK, RBLOCK], float('-inf'), tl.float32)
    for roff in range(0, 50, RBLOCK):
        rl = (roff + tl.arange(0, RBLOCK)[None, :]).to(tl.int64)
        rzero = xzero + rl * 0
        rmask = xmask & (rl < 50)
        r0 = rl
        t1 = tl.load(in0 + (rzero + 12 * r0 + x0), mask=rmask, other=0)
        acc0_lvalue = tl.where(rmask, op_max(acc0_lvalue, t1.to(tl.float32)), acc0_lvalue)
    acc0_value = tl.reduce(acc0_lvalue, 1, op_max)[:, None]
    acc1_lvalue = tl.full([XBLOCK, RBLOCK], 0, tl.float64)
    for roff in range(0, 50, RBLOCK):
        rl = (roff + tl.arange(0, RBLOCK)[None, :]).to(tl.int64)
        rzero = xzero + rl * 0
        rmask = xmask & (rl < 50)
        r0 = rl
        t2 = tl.load(in0 + (rzero + 12 * r0 + x0), mask=rmask, other=0)
        t3 = acc0_value
        t4 = (t2 - t3)
        t5 = libdevice.exp(t4)
        acc1_lvalue = tl.where(rmask, acc1_lvalue + t5.to(tl.float64), acc1_lvalue)
        tl.store(out0 + (rzero + r0 + 50 * x0), t5, mask=rmask)
    acc1_value = tl.reduce(acc1_lvalue, 1, combine_sum)[:, None]
    for roff in range(0, 50, RBLOCK):
        rl = (roff + tl.arange(0, RBLOCK)[None, :]).to(tl.int64)
        rzero = xzero + rl * 0
        rmask = xmask & (rl < 50)
        r0 = rl
        t6 = tl.load(out0 + (rzero + r0 + 50 * x0), mask=rmask, other=0)
        t7 = acc1_value
        t8 = t7.to(tl.float32)
        t9 = (t6 / t8)
        tl.store(out0 + (rzero + r0 + 50 * x0), t9, mask=rmask)


def fused_clone_amax_sub_exp_sum_and_1_more_0(args, nthreads=0):
    fused_clone_amax_sub_exp_sum_and_1_more_0_kernel[(1,)](*args, XBLOCK=16, RBLOCK=64, num_warps=4)
    return 0
