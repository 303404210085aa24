"""opfuse's depthwise convolution (NHWC, float32): C source, and the filters packed taps
first. A tile is a range of output pixels x all channels; the epilogue then runs over it in
cache, as a blocked GEMM's does (backends/c/gemm.py).

Each 16 channels hold their KH x KW filter taps in vector registers while the pixels of an
output row pass: 8 (then 4, then 1) pixels at a time where their windows lie inside the
input, one at a time with each tap checked at the borders. Without AVX-512, each 8
channels and 4 pixels at a time (in AVX2's 16 registers a 3x3 filter's 16-channel taps
took 18 and spilled: 1.5x oneDNN's time). The sizes are constants where the kernel is
inlined, so every loop over taps and pixels unrolls. Against oneDNN's call through torch
(2 threads, with a ReLU6 pass): 14x14x384 15 us against ~42, 7x7x960 10 against ~39,
112x112x96/2 84 against ~116; ONNX Runtime's own kernels 18, 15 and 86.
"""

from __future__ import annotations

import torch

from ...lower.depthwise import DepthwiseKernel
from ...lower.dw_gemm import DwGemmKernel
from ...lower.epilogue import TILE_COL, TILE_ROW
from ...lower.kernel import Kernel
from .emit import STORAGE
from .gemm import tile_buffers, tile_epilogue
from .small_conv import INSIDE_COLUMNS, tile_call

OWN_DEPTHWISE = (
    INSIDE_COLUMNS
    + r"""
/* np output pixels of row oh from column ow, channels c..c+OPFUSE_VW-1: np a constant where
   inlined; `edge`: a window may leave the input (each tap checked). xn holds the image's
   rows from row0 on. */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_dw_block(const float *restrict xn, const opfuse_vec *wv,
                                   opfuse_vec b, float *restrict dst, int64_t ldc,
                                   int64_t row0, int64_t oh, int64_t ow, int np, int64_t c,
                                   int edge,
                                   int64_t H, int64_t W, int64_t C, int KH, int KW, int SH,
                                   int SW, int PH, int PW, int DH, int DW) {
  opfuse_vec acc[8];
  #pragma GCC unroll 8
  for (int p = 0; p < np; p++) acc[p] = b;
  #pragma GCC unroll 7
  for (int kh = 0; kh < KH; kh++) {
    const int64_t ih = oh * SH - PH + kh * DH;
    if (ih < 0 || ih >= H) continue;
    const float *restrict xr = xn + (ih - row0) * W * C + c;
    #pragma GCC unroll 7
    for (int kw = 0; kw < KW; kw++) {
      #pragma GCC unroll 8
      for (int p = 0; p < np; p++) {
        const int64_t iw = (ow + p) * SW - PW + kw * DW;
        if (edge && (iw < 0 || iw >= W)) continue;
        opfuse_vec xv;
        memcpy(&xv, xr + iw * C, sizeof(xv));
        acc[p] += xv * wv[kh * KW + kw];
      }
    }
  }
  #pragma GCC unroll 8
  for (int p = 0; p < np; p++) memcpy(dst + p * ldc, &acc[p], sizeof(acc[p]));
}

/* One channel past the last full vector (C no multiple of OPFUSE_VW), one pixel. */
static inline float opfuse_dw_one(const float *restrict xn, const float *restrict wp,
                                  float b, int64_t row0, int64_t oh, int64_t ow, int64_t c,
                                  int64_t H,
                                  int64_t W, int64_t C, int KH, int KW, int SH, int SW, int PH,
                                  int PW, int DH, int DW) {
  float acc = b;
  for (int kh = 0; kh < KH; kh++) {
    const int64_t ih = oh * SH - PH + kh * DH;
    if (ih < 0 || ih >= H) continue;
    for (int kw = 0; kw < KW; kw++) {
      const int64_t iw = ow * SW - PW + kw * DW;
      if (iw < 0 || iw >= W) continue;
      acc = __builtin_fmaf(xn[((ih - row0) * W + iw) * C + c], wp[(kh * KW + kw) * C + c],
                           acc);
    }
  }
  return acc;
}

/* tile[r - r0][c] for output pixels r in [r0, r0 + rows) (n, oh, ow flattened) and every
   channel; wp: the filters [KH * KW][C], then the bias [C]. Image n's rows from row0 on
   start at x + n * xs (a whole input: xs = H * W * C, row0 = 0; the rows a fused kernel
   computed for one image's band: xs = 0, row0 its first row). */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_dw_tile(const float *restrict x, int64_t xs, int64_t row0,
                                  const float *restrict wp, float *restrict tile, int64_t ldc,
                                  int64_t r0, int64_t rows,
                                  int64_t H, int64_t W, int64_t C, int64_t OH, int64_t OW,
                                  int KH, int KW, int SH, int SW, int PH, int PW, int DH,
                                  int DW) {
  const float *restrict bias = wp + (int64_t)KH * KW * C;
  int64_t lo, hi;
  opfuse_inside_columns(W, KW, SW, PW, DW, &lo, &hi);
  const int64_t r1 = r0 + rows;
  int64_t r = r0;
  while (r < r1) {
    const int64_t n = r / (OH * OW), oh = (r / OW) % OH, ow0 = r % OW;
    const int64_t ow1 = ow0 + (OW - ow0 < r1 - r ? OW - ow0 : r1 - r);
    const float *restrict xn = x + n * xs;
    float *restrict row = tile + (r - r0 - ow0) * ldc; /* + ow * ldc: pixel ow */
    int64_t c = 0;
    for (; c + OPFUSE_VW <= C; c += OPFUSE_VW) {
      opfuse_vec wv[49], b; /* lower/depthwise.MAX_TAPS */
      for (int t = 0; t < KH * KW; t++) memcpy(&wv[t], wp + t * C + c, sizeof(wv[t]));
      memcpy(&b, bias + c, sizeof(b));
      float *restrict dst = row + c;
#define OPFUSE_DW(np, edge) \
  opfuse_dw_block(xn, wv, b, dst + ow * ldc, ldc, row0, oh, ow, np, c, edge, H, W, C, KH, KW, \
                  SH, SW, PH, PW, DH, DW)
      int64_t ow = ow0;
      for (; ow < ow1 && ow < lo; ow++) OPFUSE_DW(1, 1);
#ifdef __AVX512F__ /* 8 pixels' sums in 8 of 32 registers; 4 in AVX2's 16 (the taps take 9) */
      for (; ow + 8 <= ow1 && ow + 7 <= hi; ow += 8) OPFUSE_DW(8, 0);
#endif
      for (; ow + 4 <= ow1 && ow + 3 <= hi; ow += 4) OPFUSE_DW(4, 0);
      for (; ow < ow1 && ow <= hi; ow++) OPFUSE_DW(1, 0);
      for (; ow < ow1; ow++) OPFUSE_DW(1, 1);
#undef OPFUSE_DW
    }
    for (; c < C; c++)
      for (int64_t ow = ow0; ow < ow1; ow++)
        row[ow * ldc + c] = opfuse_dw_one(xn, wp, bias[c], row0, oh, ow, c, H, W, C, KH, KW,
                                          SH, SW, PH, PW, DH, DW);
    r += ow1 - ow0;
  }
}
"""
)


def pack_filters(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[C, 1, KH, KW] filters (and [C] bias, zeros without one) as the kernel reads them:
    [KH * KW][C], then the bias."""
    c = weight.shape[0]
    taps = weight.reshape(c, -1).t().contiguous().reshape(-1)
    b = bias if bias is not None else torch.zeros(c, dtype=weight.dtype)
    return torch.cat([taps, b.reshape(-1).to(weight.dtype)]).contiguous()


def render_depthwise(name: str, k: DepthwiseKernel) -> str:
    """C for one depthwise (or few-channel: backends/c/small_conv.py) kernel. Arguments: x,
    the packed filters, the epilogue's buffers in order (the result's is scratch for the
    tiles), an unused library address."""
    g, epi = k.geometry, k.epilogue
    what = f"depthwise {g.kh}x{g.kw}/{g.sh} over {g.n}x{g.h}x{g.w}x{g.c} NHWC"
    if k.dense:
        what = f"{g.kh}x{g.kw}/{g.sh} convolution over {g.n}x{g.c}x{g.h}x{g.w} -> {k.oc}"
    lines = [
        f"/* {k.name}: {', '.join(dict.fromkeys(k.ops))}",
        f" * {what}, tiles of {k.tile_m} pixels; epilogue in cache */",
        f"int {name}(void *const *args, int nthreads) {{",
        "  const float *restrict X = (const float *)args[0];",
        "  const float *restrict WP = (const float *)args[1];",
    ]
    lines += tile_buffers(epi, k.gemm_buffer, k.in_place)
    local, res = not k.in_place, k.gemm_buffer
    rows, c = k.rows, k.tile_n
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
    if k.dense:
        lines.append("    " + tile_call(k, "tile", f"{m0}, mm"))
    else:
        lines.append(
            f"    opfuse_dw_tile(X, {g.h * g.w * c}, 0, WP, tile, {c}, {m0}, mm, {g.h}, {g.w}, "
            f"{c}, {g.oh}, {g.ow}, "
            f"{g.kh}, {g.kw}, {g.sh}, {g.sw}, {g.ph}, {g.pw}, {g.dh}, {g.dw});"
        )
    if local:  # the epilogue over the tile; its loop variables are the rows' (i0, i1)
        lines += tile_epilogue(epi, res, local, "i0", "i1", str(c))
    lines += ["  }", "  return err;", "}"]
    return "\n".join(lines) + "\n"


def render_dw_gemm(name: str, k: DwGemmKernel, project_floats: int) -> str:
    """C for a depthwise convolution feeding a matmul (lower/dw_gemm.py), with or without
    the expansion before it. Arguments: the input (the expansion's, or the depthwise
    convolution's), the packed filters and bias followed by the matmul's packed panels
    (`project_floats` of them) and the expansion's, the epilogues' inputs (the
    expansion's, the depthwise one's), the matmul epilogue's buffers (its result's is the
    scratch: per thread, [the expanded rows,] the depthwise tile, the rows the matmul
    reads, the matmul's tile), an unused library address. Each epilogue's buffers are
    declared in a block of its own: their names are their kernels' own."""
    d, gk, g, e = k.dw, k.gemm, k.dw.geometry, k.expand
    c, tm = g.c, k.tile_m
    first = 2 + len(k.expand_buffers) + len(k.dw_buffers)  # the matmul epilogue's first
    scratch = first  # without the matmul, the depthwise result's scratch comes next
    if gk is not None:
        scratch += [b.name for b in gk.epilogue.buffers].index(gk.gemm_buffer)
    m0, n0 = TILE_ROW, TILE_COL
    what = f"depthwise {g.kh}x{g.kw}/{g.sh} over {g.n}x{g.h}x{g.w}x{c} NHWC"
    if gk is not None:
        what += f", its rows @ {c}x{gk.spec.n}"
    if e is not None:
        what = f"{e.spec.m}x{c}x{e.spec.k} expansion, then {what}, bands of {k.band} rows"
    lines = [
        f"/* {k.name}: {', '.join(dict.fromkeys(k.ops))}",
        f" * {what} (opfuse's GEMM), tiles of {tm} pixels; the epilogues in cache */",
        f"int {name}(void *const *args, int nthreads) {{",
        "  const float *restrict X = (const float *)args[0];",
        "  const float *restrict WP = (const float *)args[1];",
        f"  const float *restrict B = WP + {g.kh * g.kw * c + c};",
        f"  const float *restrict BE = B + {project_floats};",
        f"  float *restrict scratch = (float *)args[{scratch}];",
        "  int err = 0;",
        f"  if (nthreads > {k.slots}) nthreads = {k.slots};",
        "  #pragma omp parallel for num_threads(nthreads) schedule(static)",
        f"  for (int64_t tm = 0; tm < {k.tasks}; tm++) {{",
        f"    float *slot = scratch + (int64_t)omp_get_thread_num() * {k.slot_floats};",
    ]
    if e is None:
        lines += [
            f"    const int64_t {m0} = tm * {tm}, {n0} = 0;",
            f"    const int64_t mm = {k.rows} - {m0} < {tm} ? {k.rows} - {m0} : {tm};",
            "    const float *restrict xs = X;",
            f"    const int64_t xstride = {g.h * g.w * c}, row0 = 0;",
            "    float *dtile = slot;",
        ]
    else:
        bands = -(-g.oh // k.band)
        reach = f"(oh1 - 1) * {g.sh} - {g.ph} + {(g.kh - 1) * g.dh + 1}"
        lines += [
            f"    const int64_t n = tm / {bands}, oh0 = tm % {bands} * {k.band};",
            f"    const int64_t oh1 = oh0 + {k.band} < {g.oh} ? oh0 + {k.band} : {g.oh};",
            f"    const int64_t lo = oh0 * {g.sh} - {g.ph}, hi = {reach};",
            f"    const int64_t row0 = lo < 0 ? 0 : lo, row1 = hi > {g.h} ? {g.h} : hi;",
            "    const int64_t xstride = 0;",
            "    float *xs = slot;",
            "    {  /* the expansion: input rows [row0, row1) of image n, in the band */",
            f"    const int64_t {m0} = (n * {g.h} + row0) * {g.w}, {n0} = 0;",
            f"    const int64_t mm = (row1 - row0) * {g.w};",
            f"    opfuse_gemm_tile(X + {m0} * {e.spec.a.ld}, {e.spec.a.ld}, BE, xs, {c}, (int)mm, "
            f"{c}, {e.spec.k}, 0);",
        ]
        lines.append("    float *tile = xs;")
        # the expansion's rows are stored over its GEMM's, in place
        lines += _block_epilogue(e.epilogue, e.gemm_buffer, (k.expanded_value, "xs"), 2, c, True)
        lines += [
            "    }",
            f"    const int64_t {m0} = (n * {g.oh} + oh0) * {g.ow}, {n0} = 0;",
            f"    const int64_t mm = (oh1 - oh0) * {g.ow};",
            f"    float *dtile = slot + {k.band_rows * g.w * c};",
        ]
    first_dw = 2 + len(k.expand_buffers)
    # where the depthwise rows go: the rows the matmul reads (atile) when no epilogue makes
    # them; without the matmul (lower/dw_gemm.NAME2) and with no epilogue, the output
    into = "dtile"
    if gk is not None:
        lines.append(f"    float *atile = dtile + {tm * c}, *ctile = atile + {tm * c};")
        into = "atile" if d.in_place else "dtile"
    elif d.in_place:
        at = next(i for i, b in enumerate(k.dw_buffers) if b.role == "out")
        lines.append(f"    dtile = (float *)args[{first_dw + at}] + {m0} * {c};")
    lines.append(
        f"    opfuse_dw_tile(xs, xstride, row0, WP, {into}, {c}, {m0}, mm, {g.h}, {g.w}, {c}, "
        f"{g.oh}, {g.ow}, {g.kh}, {g.kw}, {g.sh}, {g.sw}, {g.ph}, {g.pw}, {g.dh}, {g.dw});"
    )
    if not d.in_place:  # the depthwise epilogue: dtile -> the rows the matmul reads, or
        # (without the matmul) the outputs
        stored = (k.rows_value, "atile") if gk is not None else None
        lines += ["    {", "    float *tile = dtile;"]
        lines += _block_epilogue(d.epilogue, d.gemm_buffer, stored, first_dw, c)
        lines.append("    }")
    if gk is None:
        lines += ["  }", "  return err;", "}"]
        return "\n".join(lines) + "\n"
    n = gk.spec.n
    lines.append("    {")
    buffers = tile_buffers(gk.epilogue, gk.gemm_buffer, gk.in_place, first=first)
    lines += ["  " + line for line in buffers]
    out = f"{gk.gemm_buffer} + {m0} * {n}" if gk.in_place else "ctile"
    lines += [
        f"    float *tile = {out};",
        f"    const int nn = {n};",
        f"    opfuse_gemm_tile(atile, {c}, B, tile, {n}, (int)mm, nn, {c}, 0);",
    ]
    lines += tile_epilogue(gk.epilogue, gk.gemm_buffer, not gk.in_place, "i0", "i1", "nn")
    lines += ["    }", "  }", "  return err;", "}"]
    return "\n".join(lines) + "\n"


def _block_epilogue(
    epi: Kernel,
    result: str,
    stored: tuple[str, str] | None,
    first: int,
    cols: int,
    overwritten: bool = False,
) -> list[str]:
    """An epilogue inside the fused kernel: its inputs from args[first] on (all but its
    result, read from `tile`), its one output, `stored` = (value, C pointer it is written
    to: the store index rewritten by lower/dw_gemm.store_in_tile); `overwritten`: that
    pointer is `tile`'s. Without `stored`, its outputs are arguments too (in order)."""
    value, into = stored if stored is not None else ("", "")
    lines = []
    j = first
    for b in epi.buffers:
        t = STORAGE[b.dtype]
        if stored is not None and b.value == value and b.role == "out":
            lines.append(f"    {t} *{b.name} = {into};")
        elif b.role == "out":
            lines.append(f"    {t} *restrict {b.name} = ({t} *)args[{j}];")
            j += 1
        elif b.name != result:
            lines.append(f"    const {t} *restrict {b.name} = (const {t} *)args[{j}];")
            j += 1
    return lines + tile_epilogue(epi, result, True, "i0", "i1", str(cols), overwritten)
