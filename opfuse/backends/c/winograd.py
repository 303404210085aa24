"""opfuse's 3x3 convolution as Winograd's F(2x2, 3x3) (float32, NHWC): C source, and the
filters packed as the kernel reads them.

A 3x3, stride-1 convolution computes each 2x2 block of outputs from the 4x4 patch of input
under it with 16 products per channel pair instead of 36 (Lavin and Gray, "Fast
Algorithms for Convolutional Neural Networks", 2016):

    Y = A^T [ (G g G^T) * (B^T d B) ] A          (* elementwise, summed over channels)

The filters' transform U = G g G^T is computed once, in float64, when the weights are
packed. A task (a band of output rows x a block of output channels) transforms its
patches into V (16 matrices, tiles x C), multiplies each by its U with opfuse's GEMM
(backends/c/gemm.py: 16 matrices of tiles x C x OC, 4/9 of the direct products), and
transforms the results back into the tile, where the epilogue runs as for the other row
producers (backends/c/depthwise.py). B^T and A^T hold only 0 and +-1 and G's entries are
+-1/2 and 1: against float64 its error stays within oneDNN's direct one's
(docs/numerics.md).

Infinities do not cancel as the algebra does (inf - inf in a transform is NaN where the
direct sum is +-inf): a tile whose outputs come out inf or NaN is computed again by direct
sums over the filters as given, which the pack keeps after U and the bias.
"""

from __future__ import annotations

import torch

from ...lower.depthwise import DepthwiseKernel
from ...lower.epilogue import TILE_COL, TILE_ROW
from ...runtime.heap import weight_buffer
from .gemm import pack_panels, tile_buffers, tile_epilogue

# The transforms of F(2x2, 3x3) (Lavin and Gray): filters by G, inputs by B^T, outputs by A^T.
_G = ((1.0, 0.0, 0.0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0.0, 0.0, 1.0))

OWN_WINOGRAD = r"""
/* Direct sums for output rows [oh0, oh1) of image n, channels [n0, n0 + nn): the
   filters as given, [OC][C][3][3]; bias at n0. For tiles whose transformed sums came out
   inf or NaN. */
static void opfuse_wg_direct(const float *restrict x, const float *restrict w,
                             const float *restrict bias, float *restrict tile, int64_t ldc,
                             int64_t n, int64_t oh0, int64_t oh1, int64_t n0, int nn,
                             int64_t H, int64_t W, int64_t C, int64_t OW, int PH, int PW) {
  for (int64_t oh = oh0; oh < oh1; oh++)
    for (int64_t ow = 0; ow < OW; ow++)
      for (int j = 0; j < nn; j++) {
        float acc = 0.0f;
        for (int kh = 0; kh < 3; kh++) {
          const int64_t ih = oh - PH + kh;
          if (ih < 0 || ih >= H) continue;
          for (int kw = 0; kw < 3; kw++) {
            const int64_t iw = ow - PW + kw;
            if (iw < 0 || iw >= W) continue;
            const float *restrict xr = x + ((n * H + ih) * W + iw) * C;
            const float *restrict wr = w + (n0 + j) * C * 9 + kh * 3 + kw;
            for (int64_t c = 0; c < C; c++) acc += xr[c] * wr[c * 9];
          }
        }
        tile[((oh - oh0) * OW + ow) * ldc + j] = acc + bias[j];
      }
}

/* Output rows [oh0, oh1) of image n (oh0 even), channels [n0, n0 + nn) (n0 a multiple
   of 32), of a 3x3, stride-1 convolution of x (NHWC, dense; padding PH, PW before) into
   tile[((oh - oh0) * OW + ow) * ldc + j - n0]. up: U, 16 matrices C x OCP (OC rounded up
   to 32) in opfuse's GEMM panels, then the bias (OCP), then the filters as given. work:
   C + 16 * tiles * (C + nn) floats. */
__attribute__((noinline))
static void opfuse_wg_tile(const float *restrict x, const float *restrict up,
                           float *restrict tile, int64_t ldc, float *restrict work,
                           int64_t n, int64_t oh0, int64_t oh1, int64_t n0, int nn,
                           int64_t H, int64_t W, int64_t C, int64_t OC, int64_t OH,
                           int64_t OW, int PH, int PW) {
  const int64_t OCP = (OC + 31) / 32 * 32, TW = (OW + 1) / 2;
  const int64_t T = (oh1 - oh0 + 1) / 2 * TW, vs = T * C, ms = T * nn;
  float *restrict zeros = work, *restrict V = work + C, *restrict M = work + C + 16 * vs;
  memset(zeros, 0, (size_t)C * sizeof(float));
  const float *restrict xn = x + n * H * W * C;
  for (int64_t t = 0; t < T; t++) {
    const int64_t ih = oh0 + 2 * (t / TW) - PH, iw = 2 * (t % TW) - PW;
    const float *d[4][4];
    for (int r = 0; r < 4; r++)
      for (int s = 0; s < 4; s++) {
        const int64_t h = ih + r, w = iw + s;
        d[r][s] = h >= 0 && h < H && w >= 0 && w < W ? xn + (h * W + w) * C : zeros;
      }
    float *restrict v = V + t * C;
    #pragma omp simd
    for (int64_t c = 0; c < C; c++) {
      float e[4][4];  /* B^T d, then (B^T d) B into v */
      for (int s = 0; s < 4; s++) {
        const float d0 = d[0][s][c], d1 = d[1][s][c], d2 = d[2][s][c], d3 = d[3][s][c];
        e[0][s] = d0 - d2;
        e[1][s] = d1 + d2;
        e[2][s] = d2 - d1;
        e[3][s] = d1 - d3;
      }
      for (int i = 0; i < 4; i++) {
        v[(4 * i + 0) * vs + c] = e[i][0] - e[i][2];
        v[(4 * i + 1) * vs + c] = e[i][1] + e[i][2];
        v[(4 * i + 2) * vs + c] = e[i][2] - e[i][1];
        v[(4 * i + 3) * vs + c] = e[i][1] - e[i][3];
      }
    }
  }
  const float *restrict panels = up + n0 * C;  /* panel n0 / 32 */
  for (int xi = 0; xi < 16; xi++)
    opfuse_gemm_tile(V + xi * vs, C, panels + xi * C * OCP, M + xi * ms, nn, (int)T, nn, C, 0);
  const float *restrict bias = up + 16 * C * OCP + n0;
  int bad = 0;
  for (int64_t t = 0; t < T; t++) {
    const int64_t oh = oh0 + 2 * (t / TW), ow = 2 * (t % TW);
    const float *restrict m = M + t * nn;
    float *restrict o = tile + ((oh - oh0) * OW + ow) * ldc;
    const int down = oh + 1 < oh1, right = ow + 1 < OW;
    /* A^T m A: rows, then columns; the bias after, as the direct sums add it */
#define OPFUSE_WG_OUT                                                                      \
      float q[2][4];                                                                       \
      for (int s = 0; s < 4; s++) {                                                        \
        const float m0 = m[s * ms + j], m1 = m[(4 + s) * ms + j];                          \
        const float m2 = m[(8 + s) * ms + j], m3 = m[(12 + s) * ms + j];                   \
        q[0][s] = m0 + m1 + m2;                                                            \
        q[1][s] = m1 - m2 - m3;                                                            \
      }                                                                                    \
      const float y00 = q[0][0] + q[0][1] + q[0][2] + bias[j];                             \
      const float y01 = q[0][1] - q[0][2] - q[0][3] + bias[j];                             \
      const float y10 = q[1][0] + q[1][1] + q[1][2] + bias[j];                             \
      const float y11 = q[1][1] - q[1][2] - q[1][3] + bias[j];                             \
      bad |= (y00 - y00 != 0.0f) | (y01 - y01 != 0.0f) | (y10 - y10 != 0.0f) |            \
             (y11 - y11 != 0.0f);
    if (down && right) {
      #pragma omp simd reduction(|:bad)
      for (int j = 0; j < nn; j++) {
        OPFUSE_WG_OUT
        o[j] = y00;
        o[ldc + j] = y01;
        o[OW * ldc + j] = y10;
        o[(OW + 1) * ldc + j] = y11;
      }
    } else {
      for (int j = 0; j < nn; j++) {
        OPFUSE_WG_OUT
        o[j] = y00;
        if (right) o[ldc + j] = y01;
        if (down) o[OW * ldc + j] = y10;
        if (down && right) o[(OW + 1) * ldc + j] = y11;
      }
    }
#undef OPFUSE_WG_OUT
  }
  if (bad)
    opfuse_wg_direct(x, up + 16 * C * OCP + OCP, bias, tile, ldc, n, oh0, oh1, n0, nn, H, W,
                     C, OW, PH, PW);
}
"""


def pack_winograd(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[OC, C, 3, 3] filters (and [OC] bias) as the kernel reads them: U = G g G^T (in
    float64) as 16 matrices C x OCP, each in opfuse's GEMM panels (K x 32 floats, zeros
    past OC), then the bias (OCP, zeros past OC), then the filters as given."""
    oc, c = weight.shape[:2]
    ocp = -(-oc // 32) * 32
    g = torch.tensor(_G, dtype=torch.float64)
    u = torch.einsum("ai,ocij,bj->abco", g, weight.double(), g).float().reshape(16, c, oc)
    b = torch.zeros(ocp, dtype=torch.float32)
    if bias is not None:
        b[:oc] = bias.reshape(-1).float()
    size = 16 * c * ocp
    out = weight_buffer(size + ocp + weight.numel())
    pack_panels(u, out[:size])  # panel p holds columns 32p .. 32p + 31, zeros past OC
    torch.cat([b, weight.float().reshape(-1)], out=out[size:])
    return out


def render_winograd(name: str, k: DepthwiseKernel) -> str:
    """C for one Winograd kernel (a DepthwiseKernel with `winograd` tasks). Arguments: x,
    the packed filters (pack_winograd), the epilogue's buffers in order (the result's is
    scratch: the tile slots, if any, then each thread's work memory), an unused library
    address."""
    g, epi, wt = k.geometry, k.epilogue, k.winograd
    assert wt is not None
    res, local = k.gemm_buffer, not k.in_place
    bands = -(-g.oh // wt.band)
    images = g.n * bands  # tasks per block of channels
    m0, n0 = TILE_ROW, TILE_COL
    lines = [
        f"/* {k.name}: {', '.join(dict.fromkeys(k.ops))}",
        f" * 3x3 convolution over {g.n}x{g.h}x{g.w}x{g.c} NHWC -> {k.oc} as Winograd "
        f"F(2x2, 3x3), tasks of {wt.band} rows x {wt.block} channels; epilogue in cache */",
        f"int {name}(void *const *args, int nthreads) {{",
        "  const float *restrict X = (const float *)args[0];",
        "  const float *restrict WP = (const float *)args[1];",
    ]
    lines += tile_buffers(epi, res, k.in_place, "  float *restrict work = (float *)args[{arg}];")
    if local:
        lines.append(f"  float *restrict work = {res}_slots + {k.slots * k.tile_m * k.tile_n};")
    lines += [
        "  int err = 0;",
        f"  if (nthreads > {k.slots}) nthreads = {k.slots};",
        "  #pragma omp parallel for num_threads(nthreads) schedule(static)",
        f"  for (int64_t task = 0; task < {wt.tasks}; task++) {{",
        f"    const int64_t band = task % {images}, n = band / {bands};",
        f"    const int64_t oh0 = band % {bands} * {wt.band};",
        f"    const int64_t oh1 = oh0 + {wt.band} < {g.oh} ? oh0 + {wt.band} : {g.oh};",
        f"    const int64_t {m0} = (n * {g.oh} + oh0) * {g.ow};",
        f"    const int64_t {n0} = task / {images} * {wt.block};",
        f"    const int64_t mm = (oh1 - oh0) * {g.ow};",
        f"    const int nn = {k.oc} - {n0} < {wt.block} ? (int)({k.oc} - {n0}) : {wt.block};",
        f"    float *wk = work + (int64_t)omp_get_thread_num() * {wt.work};",
    ]
    if local:
        slot = f"(int64_t)omp_get_thread_num() * {k.tile_m * k.tile_n}"
        lines.append(f"    float *tile = {res}_slots + {slot};")
        ldc = k.tile_n
    else:
        lines.append(f"    float *tile = {res} + {m0} * {k.oc} + {n0};")
        ldc = k.oc
    lines.append(
        f"    opfuse_wg_tile(X, WP, tile, {ldc}, wk, n, oh0, oh1, {n0}, nn, {g.h}, {g.w}, "
        f"{g.c}, {k.oc}, {g.oh}, {g.ow}, {g.ph}, {g.pw});"
    )
    if local:  # the epilogue over the tile; its loop variables are the rows' (i0, i1)
        lines += tile_epilogue(epi, res, local, "i0", "i1", "nn")
    lines += ["  }", "  return err;", "}"]
    return "\n".join(lines) + "\n"
