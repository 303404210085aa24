

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
