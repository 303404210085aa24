/* fused_argmax_var_amin: aten.argmax.default, aten.var.correction, aten.amin.default
 * schedule rows; reads 4480 bytes, writes 256 bytes */
int fused_argmax_var_amin_0(void *const *args, int nthreads) {
  const float *restrict in0 = (const float *)args[0];
  int64_t *restrict out0 = (int64_t *)args[1];
  float *restrict out1 = (float *)args[2];
  float *restrict out2 = (float *)args[3];
  int err = 0;
  (void)nthreads;
  for (int64_t x0 = 0; x0 < 16; x0++) {
    float acc0_Lv[64];
    int64_t acc0_Li[64];
    for (int l = 0; l < 64; l++) { acc0_Lv[l] = (-INFINITY); acc0_Li[l] = INT64_MAX; }
    double acc1_Lmean[64];
    double acc1_Lm2[64];
    for (int l = 0; l < 64; l++) { acc1_Lmean[l] = 0; acc1_Lm2[l] = 0; }
    double acc1_n = 0;  /* elements in each lane so far */
    double acc1_tmean = 0, acc1_tm2 = 0, acc1_tn = 0;
    float acc2_L[64];
    for (int l = 0; l < 64; l++) { acc2_L[l] = INFINITY; }
    int64_t r0_b0 = 0;
    for (; r0_b0 + 64 <= 70; r0_b0 += 64) {
      acc1_n += 1; const double acc1_inv = 1 / acc1_n;
      #pragma omp simd
      for (int l = 0; l < 64; l++) {
        const int64_t r0 = r0_b0 + l;
        const float t1 = in0[r0 + 70*x0];
        const double t2 = ((double)(t1));
        { const bool tk = op_take_max_float(t1, r0, acc0_Lv[l], acc0_Li[l]);
          acc0_Lv[l] = tk ? t1 : acc0_Lv[l];
          acc0_Li[l] = tk ? (int64_t)(r0) : acc0_Li[l]; }
        { const double d = t2 - acc1_Lmean[l];
          acc1_Lmean[l] += d * acc1_inv;
          acc1_Lm2[l] += d * (t2 - acc1_Lmean[l]); }
        acc2_L[l] = op_min_float(t1, acc2_L[l]);
      }
    }
    for (int64_t r0 = r0_b0; r0 < 70; r0++) {
      const float t3 = in0[r0 + 70*x0];
      const double t4 = ((double)(t3));
      { const bool tk = op_take_max_float(t3, r0, acc0_Lv[0], acc0_Li[0]);
        acc0_Lv[0] = tk ? t3 : acc0_Lv[0];
        acc0_Li[0] = tk ? (int64_t)(r0) : acc0_Li[0]; }
      { acc1_tn += 1; const double d = t4 - acc1_tmean;
        acc1_tmean += d / acc1_tn; acc1_tm2 += d * (t4 - acc1_tmean); }
      acc2_L[0] = op_min_float(t3, acc2_L[0]);
    }
    float acc0_value = (-INFINITY);
    int64_t acc0_index = INT64_MAX;
    for (int l = 0; l < 64; l++) if (op_take_max_float(acc0_Lv[l], acc0_Li[l], acc0_value, acc0_index)) { acc0_value = acc0_Lv[l]; acc0_index = acc0_Li[l]; }
    double acc1_cnt = acc1_tn, acc1_mean = acc1_tmean, acc1_m2 = acc1_tm2;
    double acc1_Lcnt[64];
    for (int l = 0; l < 64; l++) acc1_Lcnt[l] = acc1_n;
    for (int l = 0; l < 64; l++) op_welford_merge_double(&acc1_cnt, &acc1_mean, &acc1_m2, acc1_Lcnt[l], acc1_Lmean[l], acc1_Lm2[l]);
    float acc2_value = INFINITY;
    for (int l = 0; l < 64; l++) acc2_value = op_min_float(acc2_value, acc2_L[l]);
    const double t5 = (acc1_m2 / 69.0);
    const float t6 = ((float)(t5));
    out0[x0] = acc0_index;
    out1[x0] = t6;
    out2[x0] = acc2_value;
  }
  return err;
}
