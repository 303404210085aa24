"""The C prelude shared by every generated translation unit: storage conversions for
bfloat16, NaN-propagating max/min, torch's integer division and modulo rules, reduction
combine helpers. Everything is `static inline`, so unused helpers cost nothing."""

from __future__ import annotations

from ...ir.size import C_HELPERS as SIZE_HELPERS

_FLOAT_TYPES = ("float", "double")
_INT_TYPES = ("int8_t", "int16_t", "int32_t", "int64_t", "uint8_t", "int", "bool")
_SIGNED = ("int8_t", "int16_t", "int32_t", "int64_t")

# Vector variants of libm functions exist in glibc's libmvec; declaring them lets
# `#pragma omp simd` loops call e.g. _ZGVeN16v_expf instead of expf one lane at a time.
# glibc's own declarations are only visible under -ffast-math, which would change NaN and
# Inf semantics, so opfuse declares them itself. (2.22: exp log sin cos pow; 2.35: rest.)
MVEC_BASE = ("exp", "log", "sin", "cos", "pow")
MVEC_235 = (
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "cbrt",
    "cosh",
    "erf",
    "erfc",
    "exp10",
    "exp2",
    "expm1",
    "log10",
    "log1p",
    "log2",
    "sinh",
    "tan",
    "tanh",
    "atan2",
    "hypot",
)
_BINARY = ("pow", "atan2", "hypot")


def simd_declarations(functions: tuple[str, ...]) -> str:
    out = []
    for f in functions:
        for t, suffix in (("float", "f"), ("double", "")):
            params = f"{t}, {t}" if f in _BINARY else t
            out.append(f"#pragma omp declare simd notinbranch\nextern {t} {f}{suffix}({params});")
    return "\n".join(out) + "\n"


_HEAD = r"""
#include <stdint.h>
#include <stdbool.h>
#include <string.h>
#include <math.h>
#include <omp.h>

typedef uint16_t bf16_t;

/* Vectors as wide as the machine's: AVX-512's 16 floats, else 8 (AVX2's; two NEON
   registers). opfuse's GEMM, depthwise and direct kernels size their register blocks by
   it: 16-float vectors without AVX-512 take two of AVX2's 16 registers each, and spill. */
#ifdef __AVX512F__
#define OPFUSE_VW 16
#else
#define OPFUSE_VW 8
#endif
typedef float opfuse_vec __attribute__((vector_size(OPFUSE_VW * 4)));

static inline float bf16_to_f32(bf16_t x) {
  uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline bf16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
  uint32_t u; memcpy(&u, &f, 4);
  if (f != f) return (bf16_t)0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16_t)(u >> 16);
}
"""

_EXP = r"""
/* exp without slow paths. glibc's vector expf calls the scalar one for every lane below
   about -87 (masked attention scores are -inf), and subnormal arithmetic is slow on x86;
   this one is branch-free: Cody-Waite reduction, the Cephes polynomial (<= 1 ulp), the
   exponent built as bits. NaN and +-Inf propagate. */
static inline float op_bits_float(int32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline float op_exp_float(float x) {
  const float hi = 88.72283935546875f, lo = -103.972084045410f;
  const float xc = x > hi ? hi : (x < lo ? lo : x);
  const float n = nearbyintf(xc * 1.44269504088896341f);
  /* Explicit fmaf: kernels build with -ffp-contract=off (ops round as eager's do), and
     the polynomial is ours to evaluate the fastest way. */
  float r = fmaf(-n, 0.693359375f, xc);
  r = fmaf(-n, -2.12194440e-4f, r);
  float p = 1.9875691500E-4f;
  p = fmaf(p, r, 1.3981999507E-3f);
  p = fmaf(p, r, 8.3334519073E-3f);
  p = fmaf(p, r, 4.1665795894E-2f);
  p = fmaf(p, r, 1.6666665459E-1f);
  p = fmaf(p, r, 5.0000001201E-1f);
  const float e = fmaf(p * r, r, r) + 1.0f;
  /* 2^n in two normal halves (n >= -150 here): e * 2^n1 is exact, the second product
     rounds once, also into the subnormals (checked against the earlier explicit subnormal
     path on all 2^32 inputs: bit-identical). */
  const int32_t ni = (int32_t)n;
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  float res = (e * op_bits_float((n1 + 127) << 23)) * op_bits_float((n2 + 127) << 23);
  res = x > hi ? INFINITY : res;
  res = x < lo ? 0.0f : res;
  return x != x ? x : res;
}
static inline double op_exp_double(double x) { return exp(x); }
"""

_FLOAT_HELPERS = r"""
/* torch.maximum/minimum and relu/clamp: NaN in either operand gives NaN. */
static inline T op_max_T(T a, T b) { return (a < b || b != b) ? b : a; }
static inline T op_min_T(T a, T b) { return (b < a || b != b) ? b : a; }
/* torch's floor division of floats (ATen div_floor_floating). */
static inline T op_div_floor_T(T a, T b) {
  if (b == 0) return a / b;
  T mod = FMOD(a, b);
  T div = (a - mod) / b;
  if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;
  if (div != 0) { T fl = FLOOR(div); if (div - fl > (T)0.5) fl += 1; return fl; }
  return COPYSIGN((T)0, a / b);
}
/* Python-style modulo: the result takes the divisor's sign. */
static inline T op_remainder_T(T a, T b) {
  T mod = FMOD(a, b);
  if (mod != 0 && ((b < 0) != (mod < 0))) mod += b;
  return mod;
}
/* argmax/argmin: does (v, i) replace the best (bv, bi)? NaN counts as the extreme value;
   ties go to the lower index, so results match torch's first-occurrence rule. */
static inline bool op_take_max_T(T v, int64_t i, T bv, int64_t bi) {
  if (v != v) return bv == bv || i < bi;
  if (bv != bv) return false;
  return v > bv || (v == bv && i < bi);
}
static inline bool op_take_min_T(T v, int64_t i, T bv, int64_t bi) {
  if (v != v) return bv == bv || i < bi;
  if (bv != bv) return false;
  return v < bv || (v == bv && i < bi);
}
/* Chan et al.: merge (nb, mb, m2b) into the running (n, mean, m2). */
static inline void op_welford_merge_T(T *n, T *mean, T *m2, T nb, T mb, T m2b) {
  if (nb == 0) return;
  T nn = *n + nb, d = mb - *mean;
  *mean += d * (nb / nn);
  *m2 += m2b + d * d * (*n * nb / nn);
  *n = nn;
}
"""

_INT_HELPERS = r"""
static inline bool op_take_max_T(T v, int64_t i, T bv, int64_t bi) {
  return v > bv || (v == bv && i < bi);
}
static inline bool op_take_min_T(T v, int64_t i, T bv, int64_t bi) {
  return v < bv || (v == bv && i < bi);
}
"""

# Division helpers return 0 for a zero divisor; the kernel's error flag reports it.
_SIGNED_HELPERS = r"""
static inline T op_div_trunc_T(T a, T b) {
  if (b == 0) return 0;
  if (b == -1) return (T)(0 - (uint64_t)a);
  return (T)(a / b);
}
static inline T op_div_floor_T(T a, T b) {
  if (b == 0) return 0;
  if (b == -1) return (T)(0 - (uint64_t)a);
  T q = (T)(a / b), r = (T)(a % b);
  return (r != 0 && ((r < 0) != (b < 0))) ? (T)(q - 1) : q;
}
static inline T op_fmod_T(T a, T b) { return (b == 0 || b == -1) ? 0 : (T)(a % b); }
static inline T op_shr_T(T a, T b) {  /* arithmetic, as torch's >> on signed types */
  return (b < 0 || b >= (T)(8 * sizeof a)) ? (T)(a < 0 ? -1 : 0) : (T)(a >> b);
}
static inline T op_shl_T(T a, T b) {
  return (b < 0 || b >= (T)(8 * sizeof a)) ? (T)0 : (T)((uint64_t)a << b);
}
static inline T op_remainder_T(T a, T b) {
  if (b == 0 || b == -1) return 0;
  T r = (T)(a % b);
  return (r != 0 && ((r < 0) != (b < 0))) ? (T)(r + b) : r;
}
static inline T op_pow_T(T a, T b) {
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b % 2 == 0) ? 1 : -1) : 0);
  uint64_t r = 1, x = (uint64_t)(int64_t)a;
  while (b) { if (b & 1) r *= x; b >>= 1; x *= x; }
  return (T)r;
}
"""

_UNSIGNED_HELPERS = r"""
static inline T op_div_trunc_T(T a, T b) { return b == 0 ? 0 : (T)(a / b); }
static inline T op_div_floor_T(T a, T b) { return b == 0 ? 0 : (T)(a / b); }
static inline T op_fmod_T(T a, T b) { return b == 0 ? 0 : (T)(a % b); }
static inline T op_remainder_T(T a, T b) { return b == 0 ? 0 : (T)(a % b); }
static inline T op_shr_T(T a, T b) { return b >= 8 * sizeof a ? (T)0 : (T)(a >> b); }
static inline T op_shl_T(T a, T b) { return b >= 8 * sizeof a ? (T)0 : (T)(a << b); }
static inline T op_pow_T(T a, T b) {
  uint64_t r = 1, x = a;
  while (b) { if (b & 1) r *= x; b >>= 1; x *= x; }
  return (T)r;
}
"""


def _instantiate(template: str, t: str) -> str:
    f = "f" if t == "float" else ""
    return (
        template.replace("op_max_T", f"op_max_{t}")
        .replace("op_min_T", f"op_min_{t}")
        .replace("_T(", f"_{t}(")
        .replace("FMOD", f"fmod{f}")
        .replace("FLOOR", f"floor{f}")
        .replace("COPYSIGN", f"copysign{f}")
        .replace("T ", f"{t} ")
        .replace("(T)", f"({t})")
        .replace("T *", f"{t} *")
    )


# rewrite/random.py: element i of a uniform draw is SplitMix64's output for (seed, i). Two
# 64-bit multiplies (vpmullq under -march with AVX-512DQ): ~0.25 ms per million numbers
# on 2 threads, where torch.rand takes 2.6 ms on one.
_MIX64 = r"""
static inline int64_t op_mix64(int64_t seed, int64_t counter) {
  uint64_t z = (uint64_t)seed + ((uint64_t)counter + 1u) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (int64_t)(z ^ (z >> 31));
}
"""


def build_prelude(mvec: tuple[str, ...]) -> str:
    parts = [_HEAD, "#define OPFUSE_MAX_THREADS 1024\n", simd_declarations(mvec), _EXP, _MIX64]
    parts.append(SIZE_HELPERS)
    parts += [_instantiate(_FLOAT_HELPERS, t) for t in _FLOAT_TYPES]
    parts += [_instantiate(_INT_HELPERS, t) for t in _INT_TYPES]
    parts += [
        f"static inline {t} op_not_{t}({t} a) {{ return ({t})~a; }}\n" for t in _INT_TYPES[:-1]
    ]
    parts.append("static inline bool op_not_bool(bool a) { return !a; }\n")
    parts += [_instantiate(_SIGNED_HELPERS, t) for t in _SIGNED]
    parts += [_instantiate(_UNSIGNED_HELPERS, t) for t in ("uint8_t", "bool")]
    return "".join(parts)


PRELUDE = build_prelude(MVEC_BASE + MVEC_235)
