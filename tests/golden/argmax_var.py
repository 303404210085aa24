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


# fused_argmax_var_amin_0: aten.argmax.default, aten.var.correction, aten.amin.default
# reads 4480 bytes, writes 256 bytes
@triton.jit
def fused_argmax_var_amin_0_kernel(in0, out0, out1, out2, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xl = tl.program_id(0).to(tl.int64) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xl < 16
    xzero = xl * 0
    x0 = xl
    acc0_lvalue = tl.full([XBLOCK, RBLOCK], float('-inf'), tl.float32)
    acc0_lindex = tl.full([XBLOCK, RBLOCK], 9223372036854775807, tl.int64)
    acc1_lmean = tl.full([XBLOCK, RBLOCK], 0, tl.float64)
    acc1_lm2 = tl.full([XBLOCK, RBLOCK], 0, tl.float64)
    acc1_ln = tl.full([XBLOCK, RBLOCK], 0, tl.float64)
    acc2_lvalue = tl.full([XBLOCK, RBLOCK], float('inf'), tl.float32)
    for roff in range(0, 70, RBLOCK):
        rl = (roff + tl.arange(0, RBLOCK)[None, :]).to(tl.int64)
        rzero = xzero + rl * 0
        rmask = xmask & (rl < 70)
        r0 = rl
        t1 = tl.load(in0 + (rzero + r0 + 70 * x0), mask=rmask, other=0)
        t2 = t1.to(tl.float64)
        acc0_pos = rzero + r0
        acc0_take = rmask & take_max(t1.to(tl.float32), acc0_pos, acc0_lvalue, acc0_lindex)
        acc0_lvalue = tl.where(acc0_take, t1.to(tl.float32), acc0_lvalue)
        acc0_lindex = tl.where(acc0_take, acc0_pos, acc0_lindex)
        acc1_x = t2.to(tl.float64)
        acc1_nn = tl.where(rmask, acc1_ln + 1, acc1_ln)
        acc1_d = tl.where(rmask, acc1_x - acc1_lmean, 0)
        acc1_lmean = acc1_lmean + acc1_d / tl.where(acc1_nn == 0, 1, acc1_nn)
        acc1_lm2 = acc1_lm2 + acc1_d * tl.where(rmask, acc1_x - acc1_lmean, 0)
        acc1_ln = acc1_nn
        acc2_lvalue = tl.where(rmask, op_min(acc2_lvalue, t1.to(tl.float32)), acc2_lvalue)
    acc0_value, acc0_index = tl.reduce((acc0_lvalue, acc0_lindex), 1, combine_argmax)
    acc0_value = acc0_value[:, None]
    acc0_index = acc0_index[:, None]
    acc1_mean, acc1_m2, acc1_n = tl.reduce((acc1_lmean, acc1_lm2, acc1_ln), 1, combine_welford)
    acc1_mean = acc1_mean[:, None]
    acc1_m2 = acc1_m2[:, None]
    acc2_value = tl.reduce(acc2_lvalue, 1, op_min)[:, None]
    t3 = acc0_index
    t4 = acc1_m2
    t5 = tl.full(xzero.shape, 69.0, tl.float64)
    t6 = (t4 / t5)
    t7 = t6.to(tl.float32)
    t8 = acc2_value
    tl.store(out0 + (xzero + x0), t3, mask=xmask)
    tl.store(out1 + (xzero + x0), t7, mask=xmask)
    tl.store(out2 + (xzero + x0), t8, mask=xmask)


def fused_argmax_var_amin_0(args, nthreads=0):
    fused_argmax_var_amin_0_kernel[(2,)](*args, XBLOCK=8, RBLOCK=128, num_warps=4)
    return 0
