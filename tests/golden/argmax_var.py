

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
