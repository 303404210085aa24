/* fused_add_gelu_sigmoid_mul_sub: aten.add.Tensor, aten.gelu.default, aten.sigmoid.default, aten.mul.Tensor, aten.sub.Tensor
 * schedule pointwise; reads 12672 bytes, writes 12288 bytes */
int fused_add_gelu_sigmoid_mul_sub_0(void *const *args, int nthreads) {
  const float *in0 = (const float *)args[0];
  const float *restrict in1 = (const float *)args[1];
  float *out0 = (float *)args[2];
  int err = 0;
  (void)nthreads;
  for (int64_t x0 = 0; x0 < 32; x0++) {
    #pragma omp simd
    for (int64_t x1 = 0; x1 < 96; x1++) {
      const float t1 = in0[96*x0 + x1];
      const float t2 = in1[x1];
      const float t3 = (t1 + t2);
      const float t4 = (t3 * 0.5f);
      const float t5 = (t3 * 0.7071067811865476f);
      const float t6 = erff(t5);
      const float t7 = (1.0f + t6);
      const float t8 = (t4 * t7);
      const float t9 = (1 / (1 + op_exp_float(-t1)));
      const float t10 = (t8 * t9);
      const float t11 = (t10 - 0.5f);
      out0[96*x0 + x1] = t11;
    }
  }
  return err;
}
