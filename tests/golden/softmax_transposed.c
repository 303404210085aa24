/* fused_clone_amax_sub_exp_sum_and_1_more: aten.clone.default, aten.amax.default, aten.sub.Tensor, aten.exp.default, aten.sum.dim_IntList, aten.div.Tensor
 * schedule columns; reads 2400 bytes, writes 2400 bytes */
int fused_clone_amax_sub_exp_sum_and_1_more_0(void *const *args, int nthreads) {
  const float *restrict in0 = (const float *)args[0];
  float *restrict out0 = (float *)args[1];
  int err = 0;
  (void)nthreads;
  for (int64_t x0_blk = 0; x0_blk < 1; x0_blk++) {
    const int64_t nl = 12 - x0_blk * 512 < 512 ? 12 - x0_blk * 512 : 512;
    float acc0_L[512];
    for (int l = 0; l < nl; l++) { acc0_L[l] = (-INFINITY); }
    for (int64_t r0 = 0; r0 < 50; r0++) {
      #pragma omp simd
      for (int l = 0; l < nl; l++) {
        const int64_t x0 = x0_blk * 512 + l;
        const float t1 = in0[12*r0 + x0];
        acc0_L[l] = op_max_float(t1, acc0_L[l]);
      }
    }
    double acc1_L[512];
    for (int l = 0; l < nl; l++) { acc1_L[l] = 0; }
    for (int64_t r0 = 0; r0 < 50; r0++) {
      #pragma omp simd
      for (int l = 0; l < nl; l++) {
        const int64_t x0 = x0_blk * 512 + l;
        const float t2 = in0[12*r0 + x0];
        const float t3 = (t2 - acc0_L[l]);
        const float t4 = op_exp_float(t3);
        acc1_L[l] += t4;
        out0[r0 + 50*x0] = t4;
      }
    }
    for (int64_t r0 = 0; r0 < 50; r0++) {
      float x0_s0[512];
      #pragma omp simd
      for (int l = 0; l < nl; l++) {
        const int64_t x0 = x0_blk * 512 + l;
        x0_s0[l] = out0[r0 + 50*x0];
      }
      #pragma omp simd
      for (int l = 0; l < nl; l++) {
        const int64_t x0 = x0_blk * 512 + l;
        const float t5 = x0_s0[l];
        const float t6 = ((float)(acc1_L[l]));
        const float t7 = (t5 / t6);
        out0[r0 + 50*x0] = t7;
      }
    }
  }
  return err;
}
