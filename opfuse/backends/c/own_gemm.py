"""opfuse's own GEMM kernel: the C source every module with a tile computed by it
includes (opfuse_gemm_tile), and what decides which of its parts a module compiles."""

from __future__ import annotations

from ...ir.size import is_size
from ...lower.epilogue import GemmKernel
from ...lower.gemm_tiles import OWN_PANEL

# opfuse's GEMM. A strip of up to 6 rows times a panel of 32 columns is summed in 12 vector
# registers of 16 floats, and the partial sums of up to 8 such blocks in 12 more, so nothing
# spills (8 rows, whose 32 registers spilled the partial sums, ran 15-30% slower). Without
# AVX-512 the strip takes the panel in two passes of 16 columns, its 12 sums in 8-float
# vectors: AVX2's 16 registers could not hold a pass of 32 columns, and gcc spilled every
# sum (a Zen 2 core: 2.3 GF/s at 128x768x768, MKL 75, two passes 93). B comes
# packed at compile time, panel by panel, K x 32 floats each (zero beyond the matrix), a
# panel's columns 0-15 for every k, then its columns 16-31 (pack_panels): each k reads
# two vectors of B and broadcasts 6 numbers of A, and each of AVX2's passes reads K x 16
# floats in a row where rows of 32 had it read every other line (a Zen 2, 1008x768x3072
# alone: 0.96-0.97x the time). Products are summed in
# three levels -- 32 k in registers, 8 such blocks, then those sums in order -- which keeps
# each chain short: against float64, its max error was never above MKL's in 250 random
# linears (docs/numerics.md). GNU C vectors, not intrinsics: any target gcc vectorises for;
# the FMA is allowed here only (-ffp-contract=off elsewhere).
# A frozen weight in a model comes from memory, not cache: the first strip over each panel
# waited for it at memory speed (a 128x768x3072 linear cycling through 16 weights ran 8%
# slower than on one). A tile of OPFUSE_PF_MIN..OPFUSE_PF_MAX full strips asks the next
# panel into L2 while it computes the current one, each strip its share, a few lines before
# each block of 32 k (all of a strip's share at its start was slower than none). Fewer
# strips (a matrix of few rows: asking its next range of k into L2 was no faster at
# 8x4096x4096) or more (the panel's wait spread over them; prefetching made ResNet-50 b8
# and ViT-B/16 b8 1-2% slower) ask nothing, nor do
# the fused depthwise blocks (their weights stay in cache from band to band; MobileNetV2 b1
# 1.01x slower) and a B the kernel packs itself.
OWN_NR = OWN_PANEL
OWN_GEMM = r"""
#define OPFUSE_MR 6
#define OPFUSE_PF_MIN 3
#define OPFUSE_PF_MAX 48
#define OPFUSE_KC 512  /* k per range of a panel of few strips: a multiple of 8 blocks of 32 */
/* Vectors of OPFUSE_VW floats (the prelude's: the machine's width), so that a pass of a
   strip keeps its 12 sums in registers: 32 columns a pass with AVX-512, 16 without (two
   passes over a panel; 16 ymm registers hold no more), or all 32 (4 vectors) for a strip
   of at most 3 rows. */
#if OPFUSE_VW == 16
#define OPFUSE_NV 2
#else
#define OPFUSE_NV 4
#endif
#if OPFUSE_VW == 8 && defined(__FMA__)
#include <immintrin.h>
/* the FMA spelt out: gcc, given a tile's sizes as constants, split some of the 8-wide
   multiply-adds into a multiply and an add (rounded twice) despite fp-contract */
#define OPFUSE_MADD(acc, s, b) \
  ((acc) = (opfuse_vec)_mm256_fmadd_ps(_mm256_set1_ps(s), (__m256)(b), (__m256)(acc)))
#else
#define OPFUSE_MADD(acc, s, b) ((acc) += (s) * (b))
#endif

/* Vector v (of OPFUSE_VW floats) of a panel's row k: columns 0-15 of every k come first,
   then columns 16-31, hs (K x 16) floats further on. */
#define OPFUSE_PANEL_AT(bp, hs, k, v) \
  ((bp) + ((v) * OPFUSE_VW / 16) * (hs) + (k) * 16 + (v) * OPFUSE_VW % 16)

/* acc[i] += a[i, k] * B[k] over k in [k0, k1), for i < rows, over `halves` vectors of
   the panel's columns from bp on (vectors 0 and 1 of OPFUSE_PANEL_AT): called with rows and
   halves constants, so that gcc unrolls the rows and keeps acc in registers. */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_gemm_block(opfuse_vec acc[OPFUSE_MR][2], const float *restrict a,
                                     int64_t lda, const float *restrict bp, int64_t hs,
                                     int64_t k0, int64_t k1, int rows, int halves) {
  for (int64_t k = k0; k < k1; k++) {
    opfuse_vec b0, b1 = {0};  /* memcpy: no alignment assumed of the packed buffer */
    memcpy(&b0, OPFUSE_PANEL_AT(bp, hs, k, 0), sizeof b0);
    if (halves == 2) memcpy(&b1, OPFUSE_PANEL_AT(bp, hs, k, 1), sizeof b1);
    #pragma GCC unroll 6
    for (int i = 0; i < rows; i++) {
      const float av = a[i * lda + k];
      OPFUSE_MADD(acc[i][0], av, b0);
      if (halves == 2) OPFUSE_MADD(acc[i][1], av, b1);
    }
  }
}

/* One pass of a strip: c[rows x w] = a[rows x K] @ the 2 * OPFUSE_VW columns of the panel
   from bp on (w of them stored). Always inlined, and called with rows the constant
   OPFUSE_MR for full strips: gcc then unrolls every row loop, keeps the sums in registers
   and zeroes them without calls (a variable row count left them in memory, cleared by
   memset calls on every block of 32 k: a third of the strip's time at K=64). `halves` (a
   constant too): 1 where w <= OPFUSE_VW, whose other columns would be zeros. Before each
   block of 32 k it asks pf_step lines from pf on into L2 (0: none). */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_gemm_pass(const float *restrict a, int64_t lda,
                                    const float *restrict bp, int64_t hs, float *restrict c,
                                    int64_t ldc, int rows, int w, int64_t K, int halves,
                                    const float *pf, int pf_step) {
  opfuse_vec s[OPFUSE_MR][2], mid[OPFUSE_MR][2], acc[OPFUSE_MR][2];
  const opfuse_vec zero = {0};
  #pragma GCC unroll 6
  for (int i = 0; i < OPFUSE_MR; i++) s[i][0] = s[i][1] = mid[i][0] = mid[i][1] = zero;
  if (K <= 32) {
    /* one block: its sums are the result (adding them to zeros cost a fifth of the
       strip at K = 16; an exact zero sum may come out -0 instead of +0) */
    opfuse_gemm_block(s, a, lda, bp, hs, 0, K, rows, halves);
    K = 0;
  }
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const int64_t k1 = k0 + 32 < K ? k0 + 32 : K;
    #pragma GCC unroll 6
    for (int i = 0; i < OPFUSE_MR; i++) acc[i][0] = acc[i][1] = zero;
    for (int j = 0; j < pf_step; j++) __builtin_prefetch(pf + j * 16, 0, 2);
    pf += pf_step * 16;
    opfuse_gemm_block(acc, a, lda, bp, hs, k0, k1, rows, halves);
    #pragma GCC unroll 6
    for (int i = 0; i < OPFUSE_MR; i++) {
      mid[i][0] += acc[i][0];
      mid[i][1] += acc[i][1];
    }
    if ((k0 / 32) % 8 == 7 || k1 == K) {
      #pragma GCC unroll 6
      for (int i = 0; i < OPFUSE_MR; i++) {
        s[i][0] += mid[i][0];
        s[i][1] += mid[i][1];
        mid[i][0] = mid[i][1] = zero;
      }
    }
  }
  #pragma GCC unroll 6
  for (int i = 0; i < rows; i++) {
    if (w == OPFUSE_VW * halves) {
      memcpy(c + i * ldc, &s[i][0], sizeof s[i][0]);
      if (halves == 2) memcpy(c + i * ldc + OPFUSE_VW, &s[i][1], sizeof s[i][1]);
    } else {
      float t[2 * OPFUSE_VW];
      memcpy(t, &s[i][0], sizeof s[i][0]);
      if (halves == 2) memcpy(t + OPFUSE_VW, &s[i][1], sizeof s[i][1]);
      for (int j = 0; j < w; j++) c[i * ldc + j] = t[j];
    }
  }
}

/* opfuse_gemm_block for up to OPFUSE_NV vectors (nv of them) */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_gemm_block_nv(opfuse_vec acc[OPFUSE_MR][OPFUSE_NV],
                                        const float *restrict a, int64_t lda,
                                        const float *restrict bp, int64_t hs, int64_t k0,
                                        int64_t k1, int rows, int nv) {
  for (int64_t k = k0; k < k1; k++) {
    opfuse_vec b[OPFUSE_NV];
    #pragma GCC unroll 4
    for (int v = 0; v < nv; v++) memcpy(&b[v], OPFUSE_PANEL_AT(bp, hs, k, v), sizeof b[v]);
    #pragma GCC unroll 6
    for (int i = 0; i < rows; i++) {
      const float av = a[i * lda + k];
      #pragma GCC unroll 4
      for (int v = 0; v < nv; v++) OPFUSE_MADD(acc[i][v], av, b[v]);
    }
  }
}

/* A pass as above over k in [kb, ke) only, of up to 4 vectors (OPFUSE_NV without AVX-512)
   for a strip of at most 3 rows: its sums start from c's where `load` (a later range of
   K), from zero else. Ranges start at multiples of 8 blocks of 32 k, so the sums are
   taken in the same order as in one pass over K. A function of its own: the loads of c
   and a fourth vector, in the pass above, made the strips of many rows slower (128x768x768
   on a Zen 2: 1.4-1.8x the time). */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_gemm_range(const float *restrict a, int64_t lda,
                                     const float *restrict bp, int64_t hs, float *restrict c,
                                     int64_t ldc, int rows, int w, int64_t kb, int64_t ke,
                                     int load, int nv) {
  opfuse_vec s[OPFUSE_MR][OPFUSE_NV], mid[OPFUSE_MR][OPFUSE_NV], acc[OPFUSE_MR][OPFUSE_NV];
  const opfuse_vec zero = {0};
  #pragma GCC unroll 6
  for (int i = 0; i < OPFUSE_MR; i++)
    #pragma GCC unroll 4
    for (int v = 0; v < nv; v++) s[i][v] = mid[i][v] = zero;
  if (load) {
    #pragma GCC unroll 6
    for (int i = 0; i < rows; i++) {
      float t[OPFUSE_NV * OPFUSE_VW] = {0};
      for (int j = 0; j < w; j++) t[j] = c[i * ldc + j];
      #pragma GCC unroll 4
      for (int v = 0; v < nv; v++) memcpy(&s[i][v], t + v * OPFUSE_VW, sizeof zero);
    }
  }
  for (int64_t k0 = kb; k0 < ke; k0 += 32) {
    const int64_t k1 = k0 + 32 < ke ? k0 + 32 : ke;
    #pragma GCC unroll 6
    for (int i = 0; i < OPFUSE_MR; i++)
      #pragma GCC unroll 4
      for (int v = 0; v < nv; v++) acc[i][v] = zero;
    opfuse_gemm_block_nv(acc, a, lda, bp, hs, k0, k1, rows, nv);
    #pragma GCC unroll 6
    for (int i = 0; i < OPFUSE_MR; i++)
      #pragma GCC unroll 4
      for (int v = 0; v < nv; v++) mid[i][v] += acc[i][v];
    if ((k0 / 32) % 8 == 7 || k1 == ke) {
      #pragma GCC unroll 6
      for (int i = 0; i < OPFUSE_MR; i++)
        #pragma GCC unroll 4
        for (int v = 0; v < nv; v++) {
          s[i][v] += mid[i][v];
          mid[i][v] = zero;
        }
    }
  }
  #pragma GCC unroll 6
  for (int i = 0; i < rows; i++) {
    if (w == OPFUSE_VW * nv) {
      #pragma GCC unroll 4
      for (int v = 0; v < nv; v++) memcpy(c + i * ldc + v * OPFUSE_VW, &s[i][v], sizeof zero);
    } else {
      float t[OPFUSE_NV * OPFUSE_VW];
      #pragma GCC unroll 4
      for (int v = 0; v < nv; v++) memcpy(t + v * OPFUSE_VW, &s[i][v], sizeof zero);
      for (int j = 0; j < w; j++) c[i * ldc + j] = t[j];
    }
  }
}

/* One strip over a panel: c[rows x w] = a[rows x K] @ the panel's w columns; `halves`: 1
   where w <= 16. One pass where vectors hold 16 floats, else a pass per 16 columns (both
   of 2 vectors: a panel's columns past w are zeros), or for at most 3 rows one range of 4
   vectors. `ranged` (a constant): k in [kb, ke) only, the sums from c's where `load`
   (opfuse_gemm_range); else all of K = ke. The sums of each output are taken in the same
   order every way. Without AVX-512 a ranged strip is always one of at most 3 rows over a
   full panel (opfuse_gemm_ranges, OPFUSE_RANGE_MR). */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_gemm_strip(const float *restrict a, int64_t lda,
                                     const float *restrict bp, int64_t hs, float *restrict c,
                                     int64_t ldc, int rows, int w, int ranged, int64_t kb,
                                     int64_t ke, int load, int halves, const float *pf,
                                     int pf_step) {
#if OPFUSE_VW == 16
  if (ranged)
    opfuse_gemm_range(a, lda, bp, hs, c, ldc, rows, w, kb, ke, load, halves);
  else
    opfuse_gemm_pass(a, lda, bp, hs, c, ldc, rows, w, ke, halves, pf, pf_step);
#else
  if (rows <= 3 && halves == 2) {
    /* each sum waits on the FMA before it: two passes of few sums waited twice as long
       (8x1024x512 on a Zen 2: the strip of 2 rows cost 0.6 of the strip of 6, one range
       of 4 vectors 0.35) */
    opfuse_gemm_range(a, lda, bp, hs, c, ldc, rows, w, kb, ke, load, 4);
  } else {
    opfuse_gemm_pass(a, lda, bp, hs, c, ldc, rows, w < 16 ? w : 16, ke, 2, pf, pf_step);
    if (halves == 2)
      opfuse_gemm_pass(a, lda, bp + hs, hs, c + 16, ldc, rows, w - 16, ke, 2, pf, 0);
  }
#endif
}

/* The strips of rows i0 .. mm over one panel, as opfuse_gemm_strip: full strips of mr
   rows, then the last rows, each count a constant of its own (registers, as for full
   strips; counts of mr or more never occur and compile to nothing). */
#define OPFUSE_ROWS(i0, mr, ranged, kb, ke, load)                                          \
  do {                                                                                   \
    int i_ = (i0);                                                                       \
    for (; i_ + (mr) <= mm; i_ += (mr))                                                  \
      opfuse_gemm_strip(a + i_ * lda, lda, panel, K * 16, c + i_ * ldc, ldc, (mr), w,    \
                        ranged, kb, ke, load, halves, panel, 0);                         \
    const float *restrict at_ = a + i_ * lda;                                            \
    float *restrict ct_ = c + i_ * ldc;                                                  \
    switch (mm - i_) {                                                                   \
      case 1: OPFUSE_TAIL(1, mr, ranged, kb, ke, load); break;                           \
      case 2: OPFUSE_TAIL(2, mr, ranged, kb, ke, load); break;                           \
      case 3: OPFUSE_TAIL(3, mr, ranged, kb, ke, load); break;                           \
      case 4: OPFUSE_TAIL(4, mr, ranged, kb, ke, load); break;                           \
      case 5: OPFUSE_TAIL(5, mr, ranged, kb, ke, load); break;                           \
      default: break;                                                                    \
    }                                                                                    \
  } while (0)
#define OPFUSE_TAIL(r, mr, ranged, kb, ke, load) \
  if ((r) < (mr))                                \
  opfuse_gemm_strip(at_, lda, panel, K * 16, ct_, ldc, r, w, ranged, kb, ke, load, halves, \
                    panel, 0)

/* A panel of few strips over a long K (a linear at a small batch: 8x4096 @ 4096x4096),
   OPFUSE_KC k at a time, every strip over each range, the sums kept in c between ranges:
   whole, the panel (512 KiB at K = 4096) left L2 before the next strip or pass came back
   to it, which read it from L3 (8x4096x4096 on a Zen 2, two threads: 5.86 ms whole, 5.55
   in ranges). The first strip over a range reads it from memory: without AVX-512 the
   strips here are of 3 rows over all 4 vectors of the panel, so that each k's two lines
   are read together (a 6-row strip's two passes read every other line, then the rest;
   Zen 2, weights cycled from memory: 8x4096x4096 0.93-0.95x the time, 4 rows 0.72x, 6
   and 12 rows 0.85x, the order of every sum the same). */
#if OPFUSE_VW == 16
#define OPFUSE_RANGE_MR OPFUSE_MR
#else
#define OPFUSE_RANGE_MR 3
#endif
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_gemm_ranges(const float *restrict a, int64_t lda,
                                      const float *restrict panel, float *restrict c,
                                      int64_t ldc, int mm, int w, int64_t K, int halves) {
  /* one loop, `load` and the range's end run-time values: the first range's constant
     end had gcc unroll its blocks whole, 1.6x the time of 2x1024x512 */
  for (int64_t kb = 0; kb < K; kb += OPFUSE_KC) {
    const int64_t ke = kb + OPFUSE_KC < K ? kb + OPFUSE_KC : K;
    OPFUSE_ROWS(0, OPFUSE_RANGE_MR, 1, kb, ke, kb > 0);
  }
}

#ifdef OPFUSE_GEMM_RANGES
/* Out of line, for full panels only (a last panel of at most 16 columns takes K whole):
   inlined into the tile, these strips made the tile's other strips slower (64x512x512 on
   a Zen 2: 1.6x the time). Compiled only where a tile may need it (OPFUSE_GEMM_RANGES,
   gemm_ranges below): 0.75 s of gcc. */
__attribute__((optimize("fp-contract=fast"), noinline))
static void opfuse_gemm_ranges_2(const float *restrict a, int64_t lda,
                                 const float *restrict panel, float *restrict c, int64_t ldc,
                                 int mm, int w, int64_t K) {
  opfuse_gemm_ranges(a, lda, panel, c, ldc, mm, w, K, 2);
}
#endif

/* c[mm x w] = a[mm x K] @ one panel, strip by strip; halves as for the strip. */
__attribute__((optimize("fp-contract=fast"), always_inline))
static inline void opfuse_gemm_panel(const float *restrict a, int64_t lda,
                                     const float *restrict panel, float *restrict c,
                                     int64_t ldc, int mm, int w, int64_t K, int halves,
                                     const float *next) {
  int i0 = 0;
  const int strips = mm / OPFUSE_MR;
#ifdef OPFUSE_GEMM_RANGES
  if (K > OPFUSE_KC && strips < OPFUSE_PF_MIN && halves == 2) {
    opfuse_gemm_ranges_2(a, lda, panel, c, ldc, mm, w, K);
    return;
  }
#endif
  if (next && strips >= OPFUSE_PF_MIN && strips <= OPFUSE_PF_MAX) {
    /* each full strip asks its share of the next panel's lines (2 K) into L2, a few
       before each block of 32 k */
    const int64_t share = (2 * K + strips - 1) / strips, blocks = (K + 31) / 32;
    const int step = (int)((share + blocks - 1) / blocks);
    for (; i0 + OPFUSE_MR <= mm; i0 += OPFUSE_MR)
      opfuse_gemm_strip(a + i0 * lda, lda, panel, K * 16, c + i0 * ldc, ldc, OPFUSE_MR, w, 0,
                        0, K, 0, halves, next + (i0 / OPFUSE_MR) * share * 16, step);
  }
  /* the rest in a loop of its own: strips called with the constant step 0 compile
     without the prefetch (a run-time step in every strip made large-M GEMMs 2-5% slower) */
  OPFUSE_ROWS(i0, OPFUSE_MR, 0, 0, K, 0);
}
#undef OPFUSE_ROWS
#undef OPFUSE_TAIL
#undef OPFUSE_RANGE_MR

/* B[k, j] (at b + k*sk + j*sn) for j < nn packed into panels of 32 columns, K x 32 each
   (columns 0-15 of every k, then 16-31: OPFUSE_PANEL_AT), zero beyond nn: a B the graph
   computes (attention's K and V), packed per tile and call. */
static void opfuse_gemm_pack(const float *restrict b, int64_t sk, int64_t sn,
                             float *restrict bp, int64_t K, int nn) {
  for (int p = 0; p * 32 < nn; p++) {
    const int w = nn - p * 32 < 32 ? nn - p * 32 : 32;
    float *restrict dst = bp + (int64_t)p * K * 32;
    const float *restrict src = b + (int64_t)p * 32 * sn;
    if (sn == 1) {
      for (int h = 0; h < 2; h++)
        for (int64_t k = 0; k < K; k++)
          for (int j = h * 16; j < h * 16 + 16; j++)
            dst[h * K * 16 + k * 16 + j % 16] = j < w ? src[k * sk + j] : 0.0f;
    } else {  /* B transposed: walk each column of B (a row of its storage) */
      for (int j = 0; j < 32; j++)
        for (int64_t k = 0; k < K; k++)
          dst[j / 16 * K * 16 + k * 16 + j % 16] = j < w ? src[j * sn + k * sk] : 0.0f;
    }
  }
}

/* c[mm x nn] (leading dimension ldc) = a[mm x K] (lda) @ the tile's packed panels; panel
   by panel, so that one stays in L2 while the strips of A pass over it. The strips are
   inlined here, so the FMA must be allowed here too: else gcc splits it into a multiply
   and an add, which rounds twice and changes the sums. A panel of at most 16 columns (N =
   16, 144, 1000's last) is computed one vector wide: half the FMAs of a full panel. */
__attribute__((optimize("fp-contract=fast")))
static void opfuse_gemm_tile(const float *restrict a, int64_t lda, const float *restrict bp,
                             float *restrict c, int64_t ldc, int mm, int nn, int64_t K,
                             int prefetch) {
  for (int p = 0; p * 32 < nn; p++) {
    const int w = nn - p * 32 < 32 ? nn - p * 32 : 32;
    const float *restrict panel = bp + (int64_t)p * K * 32;
    const float *next = prefetch && (p + 1) * 32 < nn ? panel + K * 32 : 0;
    if (w > 16)
      opfuse_gemm_panel(a, lda, panel, c + p * 32, ldc, mm, w, K, 2, next);
    else
      opfuse_gemm_panel(a, lda, panel, c + p * 32, ldc, mm, w, K, 1, next);
  }
}
"""


OWN_KC, OWN_MR, OWN_PF_MIN = 512, 6, 3  # OPFUSE_KC, OPFUSE_MR, OPFUSE_PF_MIN above
GEMM_RANGES = "#define OPFUSE_GEMM_RANGES\n"


def gemm_ranges(k: GemmKernel) -> bool:
    """May a tile of k have fewer than OPFUSE_PF_MIN strips over a K longer than
    OPFUSE_KC (then its module compiles opfuse_gemm_ranges_2)? Rows and a K that are
    sizes (symbolic) may be any number: compiled in, no K decides (the kernel tests it)."""
    spec = k.spec
    if not k.own:
        return False
    if is_size(spec.k) or is_size(spec.m) or is_size(k.tile_m):
        return True
    if spec.k <= OWN_KC:
        return False
    last = spec.m % k.tile_m or k.tile_m  # the rows of the last row tile
    return last < OWN_PF_MIN * OWN_MR
