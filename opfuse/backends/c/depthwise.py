"""opfuse's depthwise convolution (NHWC, float32): C source, and the filters packed taps
first. A tile is a range of output pixels x all channels; the epilogue then runs over it in
cache, as a blocked GEMM's does (backends/c/gemm.py).

Each 16 channels hold their KH x KW filter taps in vector registers while the pixels of an
output row pass: 8 (then 4, then 1) pixels at a time where their windows lie inside the
input, one at a time with each tap checked at the borders. The sizes are constants where
the kernel is inlined, so every loop over taps and pixels unrolls. Against oneDNN's call
through torch (2 threads, with a ReLU6 pass): 14x14x384 15 us against ~42, 7x7x960 10
against ~39, 112x112x96/2 84 against ~116; ONNX Runtime's own kernels 18, 15 and 86.
"""

from __future__ import annotations

import torch

from ...lower.depthwise import DepthwiseKernel
from ...lower.dw_gemm import DwGemmKernel
from ...lower.epilogue import TILE_COL, TILE_ROW
from .emit import STORAGE
from .gemm import tile_buffers, tile_epilogue

OWN_DEPTHWISE = r"""
typedef float opfuse_dw_v16 __attribute__((vector_size(64)));

/* np output pixels of row oh from column ow, channels c..c+15: np a constant where
   inlined; `edge`: a window may leave the input (each tap checked). */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_dw_block(const float *restrict xn, const opfuse_dw_v16 *wv,
                                   opfuse_dw_v16 b, float *restrict dst, int64_t ldc,
                                   int64_t oh, int64_t ow, int np, int64_t c, int edge,
                                   int64_t H, int64_t W, int64_t C, int KH, int KW, int SH,
                                   int SW, int PH, int PW, int DH, int DW) {
  opfuse_dw_v16 acc[8];
  #pragma GCC unroll 8
  for (int p = 0; p < np; p++) acc[p] = b;
  #pragma GCC unroll 7
  for (int kh = 0; kh < KH; kh++) {
    const int64_t ih = oh * SH - PH + kh * DH;
    if (ih < 0 || ih >= H) continue;
    const float *restrict xr = xn + ih * W * C + c;
    #pragma GCC unroll 7
    for (int kw = 0; kw < KW; kw++) {
      #pragma GCC unroll 8
      for (int p = 0; p < np; p++) {
        const int64_t iw = (ow + p) * SW - PW + kw * DW;
        if (edge && (iw < 0 || iw >= W)) continue;
        opfuse_dw_v16 xv;
        memcpy(&xv, xr + iw * C, 64);
        acc[p] += xv * wv[kh * KW + kw];
      }
    }
  }
  #pragma GCC unroll 8
  for (int p = 0; p < np; p++) memcpy(dst + p * ldc, &acc[p], 64);
}

/* One channel past the last full 16 (C no multiple of 16), one pixel. */
static inline float opfuse_dw_one(const float *restrict xn, const float *restrict wp,
                                  float b, int64_t oh, int64_t ow, int64_t c, int64_t H,
                                  int64_t W, int64_t C, int KH, int KW, int SH, int SW, int PH,
                                  int PW, int DH, int DW) {
  float acc = b;
  for (int kh = 0; kh < KH; kh++) {
    const int64_t ih = oh * SH - PH + kh * DH;
    if (ih < 0 || ih >= H) continue;
    for (int kw = 0; kw < KW; kw++) {
      const int64_t iw = ow * SW - PW + kw * DW;
      if (iw < 0 || iw >= W) continue;
      acc = __builtin_fmaf(xn[(ih * W + iw) * C + c], wp[(kh * KW + kw) * C + c], acc);
    }
  }
  return acc;
}

/* tile[r - r0][c] for output pixels r in [r0, r0 + rows) (n, oh, ow flattened) and every
   channel; wp: the filters [KH * KW][C], then the bias [C]. */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_dw_tile(const float *restrict x, const float *restrict wp,
                                  float *restrict tile, int64_t ldc, int64_t r0, int64_t rows,
                                  int64_t H, int64_t W, int64_t C, int64_t OH, int64_t OW,
                                  int KH, int KW, int SH, int SW, int PH, int PW, int DH,
                                  int DW) {
  const float *restrict bias = wp + (int64_t)KH * KW * C;
  /* output columns [lo, hi] read windows inside the input */
  const int64_t lo = (PW + SW - 1) / SW;
  const int64_t last = W - 1 + PW - (int64_t)(KW - 1) * DW;
  const int64_t hi = last < 0 ? -1 : last / SW;
  const int64_t r1 = r0 + rows;
  int64_t r = r0;
  while (r < r1) {
    const int64_t n = r / (OH * OW), oh = (r / OW) % OH, ow0 = r % OW;
    const int64_t ow1 = ow0 + (OW - ow0 < r1 - r ? OW - ow0 : r1 - r);
    const float *restrict xn = x + n * H * W * C;
    float *restrict row = tile + (r - r0 - ow0) * ldc; /* + ow * ldc: pixel ow */
    int64_t c = 0;
    for (; c + 16 <= C; c += 16) {
      opfuse_dw_v16 wv[49], b; /* lower/depthwise.MAX_TAPS */
      for (int t = 0; t < KH * KW; t++) memcpy(&wv[t], wp + t * C + c, 64);
      memcpy(&b, bias + c, 64);
      float *restrict dst = row + c;
#define OPFUSE_DW(np, edge) \
  opfuse_dw_block(xn, wv, b, dst + ow * ldc, ldc, oh, ow, np, c, edge, H, W, C, KH, KW, SH, \
                  SW, PH, PW, DH, DW)
      int64_t ow = ow0;
      for (; ow < ow1 && ow < lo; ow++) OPFUSE_DW(1, 1);
      for (; ow + 8 <= ow1 && ow + 7 <= hi; ow += 8) OPFUSE_DW(8, 0);
      for (; ow + 4 <= ow1 && ow + 3 <= hi; ow += 4) OPFUSE_DW(4, 0);
      for (; ow < ow1 && ow <= hi; ow++) OPFUSE_DW(1, 0);
      for (; ow < ow1; ow++) OPFUSE_DW(1, 1);
#undef OPFUSE_DW
    }
    for (; c < C; c++)
      for (int64_t ow = ow0; ow < ow1; ow++)
        row[ow * ldc + c] = opfuse_dw_one(xn, wp, bias[c], oh, ow, c, H, W, C, KH, KW, SH, SW,
                                          PH, PW, DH, DW);
    r += ow1 - ow0;
  }
}
"""


def pack_filters(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[C, 1, KH, KW] filters (and [C] bias, zeros without one) as the kernel reads them:
    [KH * KW][C], then the bias."""
    c = weight.shape[0]
    taps = weight.reshape(c, -1).t().contiguous().reshape(-1)
    b = bias if bias is not None else torch.zeros(c, dtype=weight.dtype)
    return torch.cat([taps, b.reshape(-1).to(weight.dtype)]).contiguous()


def render_depthwise(name: str, k: DepthwiseKernel) -> str:
    """C for one depthwise kernel. Arguments: x, the packed filters, the epilogue's buffers
    in order (the result's is scratch for the tiles), an unused library address."""
    g, epi = k.geometry, k.epilogue
    lines = [
        f"/* {k.name}: {', '.join(dict.fromkeys(k.ops))}",
        f" * depthwise {g.kh}x{g.kw}/{g.sh} over {g.n}x{g.h}x{g.w}x{g.c} NHWC, tiles of "
        f"{k.tile_m} pixels; epilogue in cache */",
        f"int {name}(void *const *args, int nthreads) {{",
        "  const float *restrict X = (const float *)args[0];",
        "  const float *restrict WP = (const float *)args[1];",
    ]
    lines += tile_buffers(epi, k.gemm_buffer, k.in_place)
    local, res = not k.in_place, k.gemm_buffer
    rows, c = k.rows, g.c
    tiles = -(-rows // k.tile_m)
    m0, n0 = TILE_ROW, TILE_COL
    lines += ["  int err = 0;"]
    if local:
        lines.append(f"  if (nthreads > {k.slots}) nthreads = {k.slots};")
    lines += [
        "  #pragma omp parallel for num_threads(nthreads) schedule(static)",
        f"  for (int64_t tm = 0; tm < {tiles}; tm++) {{",
        f"    const int64_t {m0} = tm * {k.tile_m}, {n0} = 0;",
        f"    const int64_t mm = {rows} - {m0} < {k.tile_m} ? {rows} - {m0} : {k.tile_m};",
    ]
    if local:
        lines.append(
            f"    float *tile = {res}_slots + (int64_t)omp_get_thread_num() * {k.tile_m * c};"
        )
    else:
        lines.append(f"    float *tile = {res} + {m0} * {c};")
    lines.append(
        f"    opfuse_dw_tile(X, WP, tile, {c}, {m0}, mm, {g.h}, {g.w}, {c}, {g.oh}, {g.ow}, "
        f"{g.kh}, {g.kw}, {g.sh}, {g.sw}, {g.ph}, {g.pw}, {g.dh}, {g.dw});"
    )
    if local:  # the epilogue over the tile; its loop variables are the rows' (i0, i1)
        lines += tile_epilogue(epi, res, local, "i0", "i1", str(c))
    lines += ["  }", "  return err;", "}"]
    return "\n".join(lines) + "\n"


def render_dw_gemm(name: str, k: DwGemmKernel) -> str:
    """C for a depthwise convolution feeding a matmul (lower/dw_gemm.py). Arguments: x,
    the packed filters and bias followed by the matmul's packed panels, the depthwise
    epilogue's inputs, the matmul epilogue's buffers (its result's is the scratch: per
    thread, the depthwise tile, the rows the matmul reads, the matmul's tile), an unused
    library address. Each epilogue's buffers are declared in a block of its own: their
    names are their kernels' own."""
    d, gk, g = k.dw, k.gemm, k.dw.geometry
    c, n, tm, rows = g.c, gk.spec.n, k.tile_m, k.rows
    first = 2 + len(k.dw_buffers)  # the matmul epilogue's first argument
    scratch = first + [b.name for b in gk.epilogue.buffers].index(gk.gemm_buffer)
    m0, n0 = TILE_ROW, TILE_COL
    lines = [
        f"/* {k.name}: {', '.join(dict.fromkeys(k.ops))}",
        f" * depthwise {g.kh}x{g.kw}/{g.sh} over {g.n}x{g.h}x{g.w}x{c} NHWC, its rows @ "
        f"{c}x{n} (opfuse's GEMM), tiles of {tm} pixels; both epilogues in cache */",
        f"int {name}(void *const *args, int nthreads) {{",
        "  const float *restrict X = (const float *)args[0];",
        "  const float *restrict WP = (const float *)args[1];",
        f"  const float *restrict B = WP + {g.kh * g.kw * c + c};",
        f"  float *restrict scratch = (float *)args[{scratch}];",
        "  int err = 0;",
        f"  if (nthreads > {k.slots}) nthreads = {k.slots};",
        "  #pragma omp parallel for num_threads(nthreads) schedule(static)",
        f"  for (int64_t tm = 0; tm < {-(-rows // tm)}; tm++) {{",
        f"    const int64_t {m0} = tm * {tm}, {n0} = 0;",
        f"    const int64_t mm = {rows} - {m0} < {tm} ? {rows} - {m0} : {tm};",
        f"    float *dtile = scratch + (int64_t)omp_get_thread_num() * {k.slot_floats};",
        f"    float *atile = dtile + {tm * c}, *ctile = atile + {tm * c};",
        f"    opfuse_dw_tile(X, WP, {'atile' if d.in_place else 'dtile'}, {c}, {m0}, mm, "
        f"{g.h}, {g.w}, {c}, {g.oh}, {g.ow}, {g.kh}, {g.kw}, {g.sh}, {g.sw}, {g.ph}, {g.pw}, "
        f"{g.dh}, {g.dw});",
    ]
    if not d.in_place:  # the depthwise epilogue: dtile -> the rows the matmul reads
        rows_buf = next(b.name for b in d.epilogue.buffers if b.value == k.rows_value)
        lines += ["    {", "    float *tile = dtile;", f"    float *{rows_buf} = atile;"]
        for j, b in enumerate(k.dw_buffers):
            t = STORAGE[b.dtype]
            lines.append(f"    const {t} *restrict {b.name} = (const {t} *)args[{2 + j}];")
        lines += tile_epilogue(d.epilogue, d.gemm_buffer, True, "i0", "i1", str(c))
        lines.append("    }")
    lines.append("    {")
    lines += [
        "  " + line for line in tile_buffers(gk.epilogue, gk.gemm_buffer, gk.in_place, first=first)
    ]
    out = f"{gk.gemm_buffer} + {m0} * {n}" if gk.in_place else "ctile"
    lines += [
        f"    float *tile = {out};",
        f"    const int nn = {n};",
        f"    opfuse_gemm_tile(atile, {c}, B, tile, {n}, (int)mm, nn, {c});",
    ]
    lines += tile_epilogue(gk.epilogue, gk.gemm_buffer, not gk.in_place, "i0", "i1", "nn")
    lines += ["    }", "  }", "  return err;", "}"]
    return "\n".join(lines) + "\n"
