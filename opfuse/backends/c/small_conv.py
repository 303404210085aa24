"""opfuse's direct convolution over a few input channels (float32): an image's stem, whose
3 colour channels leave a kernel that vectorises over input channels (oneDNN's) mostly
idle. This one vectorises over output channels: each tap's input value is broadcast into
the 16-channel vectors of a block of pixels, the filters packed as [C * KH * KW][OC
rounded up to 16], then the bias. The input is read with its own strides (NCHW, NHWC or
any), so the caller's image needs no copy first. A tile is a range of output pixels x all
output channels, stored NHWC; the epilogue then runs over it in cache, as a depthwise
kernel's does (backends/c/depthwise.py).

Registers: a block of NP pixels x NV vectors (at most 4 at a time) of sums and NV filter
vectors. With AVX-512, vectors of 16 channels: 6 x 4, 8 x 3 or 12 x 2 (12 x 1), at most 28
of the 32 registers. Without it, vectors of 8 in the 16 registers AVX2 has: 3 x 4, 4 x 3,
6 x 2 or 12 x 1 (vectors of 16 there took two registers each and spilled: the stem of
MobileNetV2 ran 12x oneDNN's time).
"""

from __future__ import annotations

import torch

from ...lower.depthwise import DepthwiseKernel

# Shared with the depthwise kernel's header (either may come alone, or both).
INSIDE_COLUMNS = r"""
#ifndef OPFUSE_INSIDE_COLUMNS
#define OPFUSE_INSIDE_COLUMNS
/* The output columns [*lo, *hi] whose windows lie inside the input (no edge checks). */
static inline void opfuse_inside_columns(int64_t W, int KW, int SW, int PW, int DW,
                                         int64_t *lo, int64_t *hi) {
  *lo = (PW + SW - 1) / SW;
  const int64_t last = W - 1 + PW - (int64_t)(KW - 1) * DW;
  *hi = last < 0 ? -1 : last / SW;
}
#endif
"""

OWN_SMALL_CONV = (
    INSIDE_COLUMNS
    + r"""
/* np output pixels of row oh from column ow, output channels [0, nv * OPFUSE_VW) of
   wp's (wp, bias and dst start at the block's first channel); the last vector stores
   `tail` of its OPFUSE_VW channels. np and nv are constants where inlined: the sums
   stay in registers. */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_cv_block(const float *restrict xn, const float *restrict wp,
                                   const float *restrict bias, float *restrict dst,
                                   int64_t ldc, int64_t oh, int64_t ow, int np, int nv,
                                   int tail, int edge, int64_t SC, int64_t SH_, int64_t SW_,
                                   int64_t H, int64_t W, int C, int KH, int KW, int SH,
                                   int SW, int PH, int PW, int DH, int DW, int64_t OCP) {
  opfuse_vec acc[12][4];
  #pragma GCC unroll 12
  for (int p = 0; p < np; p++) {
    #pragma GCC unroll 4
    for (int v = 0; v < nv; v++) memcpy(&acc[p][v], bias + OPFUSE_VW * v, sizeof(acc[p][v]));
  }
  for (int c = 0; c < C; c++) {
    for (int kh = 0; kh < KH; kh++) {
      const int64_t ih = oh * SH - PH + kh * DH;
      if (ih < 0 || ih >= H) continue;
      const float *restrict xr = xn + c * SC + ih * SH_;
      const float *restrict wr = wp + (int64_t)((c * KH + kh) * KW) * OCP;
      #pragma GCC unroll 7
      for (int kw = 0; kw < KW; kw++) {
        opfuse_vec wv[4];
        #pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
          memcpy(&wv[v], wr + kw * OCP + OPFUSE_VW * v, sizeof(wv[v]));
        #pragma GCC unroll 12
        for (int p = 0; p < np; p++) {
          const int64_t iw = (ow + p) * SW - PW + kw * DW;
          if (edge && (iw < 0 || iw >= W)) continue;
          const float xv = xr[iw * SW_];
          #pragma GCC unroll 4
          for (int v = 0; v < nv; v++) acc[p][v] += xv * wv[v];
        }
      }
    }
  }
  #pragma GCC unroll 12
  for (int p = 0; p < np; p++) {
    #pragma GCC unroll 4
    for (int v = 0; v + 1 < nv; v++)
      memcpy(dst + p * ldc + OPFUSE_VW * v, &acc[p][v], sizeof(acc[p][v]));
    float *restrict last = dst + p * ldc + OPFUSE_VW * (nv - 1);
    if (tail == OPFUSE_VW) {
      memcpy(last, &acc[p][nv - 1], sizeof(acc[p][nv - 1]));
    } else {
      for (int j = 0; j < tail; j++) last[j] = acc[p][nv - 1][j];
    }
  }
}

/* One row of output pixels [ow0, ow1) for the output channels of one block of nv vectors:
   blocks of NP pixels where their windows lie inside the input, one at a time (each tap
   checked) at the borders. */
#define OPFUSE_CV_ROW(NP, NV)                                                              \
  do {                                                                                     \
    int64_t ow = ow0;                                                                      \
    for (; ow < ow1 && ow < lo; ow++) OPFUSE_CV(1, NV, 1);                                 \
    for (; ow + NP <= ow1 && ow + NP - 1 <= hi; ow += NP) OPFUSE_CV(NP, NV, 0);            \
    for (; ow < ow1 && ow <= hi; ow++) OPFUSE_CV(1, NV, 0);                                \
    for (; ow < ow1; ow++) OPFUSE_CV(1, NV, 1);                                            \
  } while (0)

/* tile[r - r0][0, OC) for output pixels r in [r0, r0 + rows) (n, oh, ow flattened); x
   with strides SN, SC, SH_, SW_ (floats); wp: the packed filters, then the bias. Not
   inlined: a function inlined into the kernel takes the kernel's -ffp-contract=off (no
   FMA, twice the instructions); the blocks inside it, inlined here, keep the FMA. */
__attribute__((optimize("fp-contract=fast"), noinline))
static void opfuse_cv_tile(const float *restrict x, int64_t SN, int64_t SC,
                                  int64_t SH_, int64_t SW_, const float *restrict wp,
                                  float *restrict tile, int64_t ldc, int64_t r0, int64_t rows,
                                  int64_t H, int64_t W, int C, int64_t OC, int64_t OH,
                                  int64_t OW, int KH, int KW, int SH, int SW, int PH, int PW,
                                  int DH, int DW) {
  const int64_t OCP = (OC + 15) / 16 * 16;
  const float *restrict bias = wp + (int64_t)C * KH * KW * OCP;
  int64_t lo, hi;
  opfuse_inside_columns(W, KW, SW, PW, DW, &lo, &hi);
  const int64_t r1 = r0 + rows;
  int64_t r = r0;
  while (r < r1) {
    const int64_t n = r / (OH * OW), oh = (r / OW) % OH, ow0 = r % OW;
    const int64_t ow1 = ow0 + (OW - ow0 < r1 - r ? OW - ow0 : r1 - r);
    const float *restrict xn = x + n * SN;
    float *restrict row = tile + (r - r0 - ow0) * ldc; /* + ow * ldc: pixel ow */
    for (int64_t c0 = 0; c0 < OC; c0 += 4 * OPFUSE_VW) {
      const int64_t left = OC - c0;
      const int nv = left >= 4 * OPFUSE_VW ? 4 : (int)((left + OPFUSE_VW - 1) / OPFUSE_VW);
      const int tail = left >= 4 * OPFUSE_VW ? OPFUSE_VW : (int)(left - OPFUSE_VW * (nv - 1));
      const float *restrict wb = wp + c0, *restrict bb = bias + c0;
      float *restrict dst = row + c0;
#define OPFUSE_CV(np, nvc, edge)                                                           \
  opfuse_cv_block(xn, wb, bb, dst + ow * ldc, ldc, oh, ow, np, nvc, tail, edge, SC, SH_,   \
                  SW_, H, W, C, KH, KW, SH, SW, PH, PW, DH, DW, OCP)
      switch (nv) {
#ifdef __AVX512F__
        case 4: OPFUSE_CV_ROW(6, 4); break;
        case 3: OPFUSE_CV_ROW(8, 3); break;
        case 2: OPFUSE_CV_ROW(12, 2); break;
#else
        case 4: OPFUSE_CV_ROW(3, 4); break;
        case 3: OPFUSE_CV_ROW(4, 3); break;
        case 2: OPFUSE_CV_ROW(6, 2); break;
#endif
        default: OPFUSE_CV_ROW(12, 1); break;
      }
#undef OPFUSE_CV
    }
    r += ow1 - ow0;
  }
}
"""
)


def pack_dense(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[OC, C, KH, KW] filters (and [OC] bias, zeros without one) as the kernel reads them:
    [C * KH * KW][OC rounded up to 16], then the bias, zeros in the channels past OC."""
    oc = weight.shape[0]
    ocp = -(-oc // 16) * 16
    taps = torch.zeros(weight[0].numel(), ocp, dtype=weight.dtype)
    taps[:, :oc] = weight.reshape(oc, -1).t()
    b = torch.zeros(ocp, dtype=weight.dtype)
    if bias is not None:
        b[:oc] = bias.reshape(-1)
    return torch.cat([taps.reshape(-1), b]).contiguous()


def tile_call(k: DepthwiseKernel, tile: str, rows: str) -> str:
    """The C call that computes a tile of the kernel's rows from X and WP."""
    g, s = k.geometry, k.x_strides
    return (
        f"opfuse_cv_tile(X, {s[0]}, {s[1]}, {s[2]}, {s[3]}, WP, {tile}, {k.oc}, {rows}, "
        f"{g.h}, {g.w}, {g.c}, {k.oc}, {g.oh}, {g.ow}, {g.kh}, {g.kw}, {g.sh}, {g.sw}, "
        f"{g.ph}, {g.pw}, {g.dh}, {g.dw});"
    )
