

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
    tl.debug_barrier()
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
