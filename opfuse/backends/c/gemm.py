"""Blocked GEMM with a fused epilogue: C source, and the library side (MKL's packed GEMM
as the torch build ships it, found by symbol, and weight packing).

Each tile of the output is computed by the library (single-threaded inside our OpenMP
region), or by opfuse's own GEMM, and the epilogue runs over the tile right away, while it
is in cache:

    parallel for each (batch, tile_m, tile_n):
        gemm(tile)                        cblas_sgemm_compute with a packed weight, sgemm,
                                          or opfuse_gemm_tile (own_gemm.py)
        for rows, simd for cols: out = epilogue(gemm_tile, ...)
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from ...lower.epilogue import TILE_COL, TILE_ROW, GemmKernel
from ...lower.kernel import Kernel
from ...runtime.heap import weight_buffer
from .emit import STORAGE, Emitter, emit_stores
from .own_gemm import OWN_NR

ROW_MAJOR, NO_TRANS, TRANS, PACKED, B_MATRIX = 101, 111, 112, 151, 162

GEMM_TYPES = r"""
typedef void (*opfuse_sgemm_compute_t)(int, int, int, int, int, int, const float *, int,
                                       const float *, int, float, float *, int);
typedef void (*opfuse_sgemm_t)(const char *, const char *, const int *, const int *,
                               const int *, const float *, const float *, const int *,
                               const float *, const int *, const float *, float *, const int *);
"""


@dataclass(frozen=True)
class Blas:
    """Addresses of the library entry points inside torch's own libraries."""

    sgemm: int
    sgemm_compute: int | None
    sgemm_pack: int | None
    sgemm_pack_get_size: int | None


@functools.lru_cache(maxsize=1)
def blas() -> Blas | None:
    """MKL as linked into libtorch_cpu (x86 builds of torch); None where it is absent."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = os.path.join(lib_dir, name)
        if not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            return None

        def addr(sym: str, lib: ctypes.CDLL = lib) -> int | None:
            try:
                return ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value
            except AttributeError:
                return None

        sgemm = addr("sgemm")
        if sgemm is None:
            return None
        return Blas(
            sgemm,
            addr("cblas_sgemm_compute"),
            addr("cblas_sgemm_pack"),
            addr("cblas_sgemm_pack_get_size"),
        )
    return None


def can_pack() -> bool:
    b = blas()
    return b is not None and None not in (b.sgemm_compute, b.sgemm_pack, b.sgemm_pack_get_size)


def _pack_fns() -> tuple[Any, Any]:
    b = blas()
    assert b is not None and b.sgemm_pack is not None and b.sgemm_pack_get_size is not None
    get_size = ctypes.CFUNCTYPE(
        ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int
    )(b.sgemm_pack_get_size)
    pack = ctypes.CFUNCTYPE(
        None,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    )(b.sgemm_pack)
    return get_size, pack


def pack_layout(k: GemmKernel) -> tuple[list[int], int]:
    """Where each column tile's packed block of B starts (floats) and the total size: the
    rendered kernel needs the offsets, the packing itself waits until the candidate is
    built (see pack_weight)."""
    get_size, _ = _pack_fns()
    spec = k.spec
    offsets = []
    total = 0
    for n0 in range(0, spec.n, k.tile_n):
        nn = min(k.tile_n, spec.n - n0)
        size = -(-get_size(B_MATRIX, k.tile_m, nn, spec.k) // 4) + 16  # floats, padded
        offsets.append(total)
        total += -(-size // 16) * 16  # 64-byte aligned blocks
    return offsets, total


def pack_weight(
    k: GemmKernel, weight: torch.Tensor, offsets: list[int], total: int
) -> torch.Tensor:
    """Pack B (a frozen weight, as the GEMM reads it: [K, N] possibly transposed) once,
    one packed block per column tile at the offsets pack_layout gave."""
    _, pack = _pack_fns()
    spec = k.spec
    # empty, not zeros, and not on huge pages: MKL reports a generous size (megabytes even
    # for a small tile) and writes only what it uses; untouched pages never become
    # resident (a huge page would, whole, under each tile's block).
    buf = torch.empty(total, dtype=torch.float32)
    base = weight.data_ptr()
    elt = weight.element_size()
    for n0, off in zip(range(0, spec.n, k.tile_n), offsets):
        nn = min(k.tile_n, spec.n - n0)
        src = base + elt * (n0 * spec.b.ld if spec.b.trans else n0)
        pack(
            ROW_MAJOR,
            B_MATRIX,
            TRANS if spec.b.trans else NO_TRANS,
            k.tile_m,
            nn,
            spec.k,
            1.0,
            src,
            spec.b.ld,
            buf.data_ptr() + 4 * off,
        )
    return buf


@dataclass(frozen=True)
class OwnPack:
    """How opfuse's GEMM reads one weight packed (B as the GEMM reads it, [K, N], its
    storage possibly transposed): panels of 32 columns, K x 32 each, zero-padded
    (pack_panels), the same for every tiling. Equal packs of one tensor are equal bytes,
    so the compiles of a graph per size share one packed copy (runtime/execute.Packed,
    execute.pack_frozen) instead of one each (BERT-base: 340 MB per size)."""

    k: int
    n: int
    trans: bool
    ld: int

    @staticmethod
    def of(kernel: GemmKernel) -> OwnPack:
        spec = kernel.spec
        return OwnPack(spec.k, spec.n, spec.b.trans, spec.b.ld)

    @property
    def total(self) -> int:
        """The floats packed: N rounded up to whole panels, times K. Column tiles are whole
        panels but for the last, so a tile at column n0 starts at float n0 * K whatever
        the tiling (which may be an expression of the sizes: gemm_tiles.own_tiles)."""
        return -(-self.n // OWN_NR) * OWN_NR * self.k

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        strides = (1, self.ld) if self.trans else (self.ld, 1)
        b = weight.as_strided((self.k, self.n), strides, weight.storage_offset())
        buf = weight_buffer(self.total)
        pack_panels(b, buf)
        return buf


def pack_panels(b: torch.Tensor, out: torch.Tensor) -> None:
    """Write [..., K, N] into `out` (contiguous, [..., panels, K, 32] elements) as opfuse's
    GEMM reads it: N zero-padded to whole panels of 32 columns, each panel's columns 0-15
    for every k, then its columns 16-31 (OPFUSE_PANEL_AT in own_gemm.OWN_GEMM)."""
    *lead, k, n = b.shape
    full, rest = divmod(n, OWN_NR)
    at, half = len(lead), OWN_NR // 2
    # out as [..., k, panel, half, column]
    dst = out.view(*lead, full + (rest > 0), 2, k, half)
    dst = dst.permute(*range(at), at + 2, at, at + 1, at + 3)
    if full:
        dst[..., :full, :, :].copy_(b[..., : full * OWN_NR].reshape(*lead, k, full, 2, half))
    if rest:
        tail = torch.nn.functional.pad(b[..., full * OWN_NR :], (0, OWN_NR - rest))
        dst[..., full, :, :].copy_(tail.reshape(*lead, k, 2, half))


def render_gemm(name: str, k: GemmKernel, packed_offsets: list[int] | None) -> str:
    """C for one blocked GEMM. Arguments: A, B (packed weight or matrix), the epilogue's
    buffers in order (the `gemm` one is scratch for the GEMM result), the library
    function's address."""
    s = k.spec
    epi = k.epilogue
    lines = [
        f"/* {k.name}: {', '.join(dict.fromkeys(k.ops))}",
        f" * blocked GEMM {s.batch}x{s.m}x{s.n}x{s.k}, tiles {k.tile_m}x{k.tile_n}, "
        f"{_core(k, packed_offsets)}; epilogue in cache */",
        f"int {name}(void *const *args, int nthreads) {{",
        "  const float *restrict A = (const float *)args[0];",
        "  const float *restrict B = (const float *)args[1];",
    ]
    # the scratch holds only the packing areas where the tiles are computed in the output
    packing = "  float *restrict packing = (float *)args[{arg}];" if k.packs_b else ""
    lines += tile_buffers(epi, k.gemm_buffer, k.in_place, packing)
    local = not k.in_place
    g = k.gemm_buffer
    fn_arg = len(epi.buffers) + 2
    if k.packs_b:  # B as the graph holds it, packed per tile below
        if local:  # the packing areas follow the tile slots
            tiles = k.slots * k.tile_m * k.tile_n
            lines.append(f"  float *restrict packing = {g}_slots + {tiles};")
    elif packed_offsets is not None:
        lines.append(
            f"  const opfuse_sgemm_compute_t gemm = (opfuse_sgemm_compute_t)args[{fn_arg}];"
        )
        offs = ", ".join(str(int(o)) for o in packed_offsets)
        lines.append(f"  static const int64_t packed_at[] = {{{offs}}};")
    else:
        lines.append(f"  const opfuse_sgemm_t gemm = (opfuse_sgemm_t)args[{fn_arg}];")
    m0, n0 = TILE_ROW, TILE_COL  # the tile's origin, by the names the epilogue reads
    tiles_m = -(-s.m // k.tile_m)
    tiles_n = -(-s.n // k.tile_n)
    lines.append("  int err = 0;")
    if local or k.packs_b:
        # no more threads than slots (the thread count may have grown since compiling)
        lines.append(f"  if (nthreads > {k.slots}) nthreads = {k.slots};")
    lines += [
        "  #pragma omp parallel for collapse(3) num_threads(nthreads) schedule(static)",
        f"  for (int64_t bb = 0; bb < {s.batch}; bb++)",
        f"  for (int64_t tm = 0; tm < {tiles_m}; tm++)",
        f"  for (int64_t tn = 0; tn < {tiles_n}; tn++) {{",
        f"    const int64_t {m0} = tm * {k.tile_m}, {n0} = tn * {k.tile_n};",
        f"    const int mm = (int)({s.m} - {m0} < {k.tile_m} ? {s.m} - {m0} : {k.tile_m});",
        f"    const int nn = (int)({s.n} - {n0} < {k.tile_n} ? {s.n} - {n0} : {k.tile_n});",
    ]
    ldc = k.tile_n if local else s.n
    if local:
        lines.append(
            f"    float *tile = {g}_slots + (int64_t)omp_get_thread_num() * {k.tile_m * k.tile_n};"
        )
    else:
        lines.append(f"    float *tile = {g} + bb * {s.m * s.n} + {m0} * {s.n} + {n0};")
    a_off = f"bb * {s.a.batch_stride} + " + (m0 if s.a.trans else f"{m0} * {s.a.ld}")
    b_off = f"bb * {s.b.batch_stride} + " + (f"{n0} * {s.b.ld}" if s.b.trans else n0)
    if k.packs_b:
        sk, sn = (1, s.b.ld) if s.b.trans else (s.b.ld, 1)
        lines += [
            f"    float *bp = packing + (int64_t)omp_get_thread_num() * {k.pack_floats};",
            f"    opfuse_gemm_pack(B + {b_off}, {sk}, {sn}, bp, {s.k}, nn);",
            f"    opfuse_gemm_tile(A + {a_off}, {s.a.ld}, bp, tile, {ldc}, mm, nn, {s.k}, 0);",
        ]
    elif k.own:
        lines.append(
            f"    opfuse_gemm_tile(A + {a_off}, {s.a.ld}, B + {n0} * {s.k}, tile, {ldc}, "
            f"mm, nn, {s.k}, 1);"
        )
    elif packed_offsets is not None:
        lines.append(
            f"    gemm({ROW_MAJOR}, {TRANS if s.a.trans else NO_TRANS}, {PACKED}, mm, nn, {s.k}, "
            f"A + {a_off}, {s.a.ld}, B + packed_at[tn], {s.k}, 0.0f, tile, {ldc});"
        )
    else:
        lines += [
            f"    const int K = {s.k}, lda = {s.a.ld}, ldb = {s.b.ld}, ldc = {ldc};",
            "    const float one = 1.0f, zero = 0.0f;",
            # column-major BLAS: tile^T = B^T A^T
            f'    gemm("{"T" if s.b.trans else "N"}", "{"T" if s.a.trans else "N"}", '
            f"&nn, &mm, &K, &one, B + {b_off}, &ldb, A + {a_off}, &lda, &zero, tile, &ldc);",
        ]
    # The epilogue over the tile. Its loop variables are the GEMM's: i0 (batch), i1, i2.
    bvar, mvar, nvar = ("i0", "i1", "i2") if s.kind == "bmm" else (None, "i0", "i1")
    if bvar:
        lines.append(f"    const int64_t {bvar} = bb;")
    lines += tile_epilogue(epi, g, local, mvar, nvar, "nn")
    lines += ["  }", "  return err;", "}"]
    return "\n".join(lines) + "\n"


def tile_buffers(
    epi: Kernel, result: str, in_place: bool, after_result: str = "", first: int = 2
) -> list[str]:
    """C declarations of a tiled kernel's epilogue buffers, from args[first] on. The `result`
    buffer (what the GEMM or convolution computes) is the threads' tile slots, named
    `<result>_slots`, or, `in_place`, the output itself; `after_result` (a format with
    {arg}: that buffer's argument) is declared after it in place."""
    out_of = {b.value: i for i, b in enumerate(epi.buffers) if b.role == "out"}
    # Each thread computes its tiles into its own tile_m x tile_n slot of the scratch
    # (leading dimension tile_n) rather than at the tile's place in a full [m, n] result:
    # rows n floats apart fell into the same L1 sets and a page each, and the kernel's
    # speed varied 2x with where the scratch lay (ViT-B's MLP: 50-120 ms).
    lines = []
    shared = {name for pair in epi.inplace for name in pair}  # may alias: no restrict
    for i, b in enumerate(epi.buffers):
        t = STORAGE[b.dtype]
        if b.name == result and in_place:
            # the tiles are computed in the output itself; bias is added in place
            lines.append(f"  {t} *{b.name} = ({t} *)args[{out_of[b.value] + first}];")
            if after_result:
                lines.append(after_result.format(arg=i + first))
            continue
        writable = b.role == "out" or b.name == result
        const = "" if writable else "const "
        restrict = "" if (in_place and b.role == "out") or b.name in shared else "restrict "
        name = f"{b.name}_slots" if not in_place and b.name == result else b.name
        lines.append(f"  {const}{t} *{restrict}{name} = ({const}{t} *)args[{i + first}];")
    return lines


def tile_epilogue(
    epi: Kernel,
    result: str,
    local: bool,
    mvar: str,
    nvar: str,
    cols: str,
    overwritten: bool = False,
) -> list[str]:
    """C for the epilogue over one tile: rows `mvar` from the tile's origin (TILE_ROW,
    `mm` of them), `cols` columns `nvar` from TILE_COL; `local`: the result is read from
    the thread's slot, `tile`, at (row - m0) * tile_n + (col - n0) (lower_blocked);
    `overwritten`: an output is stored over it in the tile (no restrict)."""
    m0, n0 = TILE_ROW, TILE_COL
    lines = [f"    for (int64_t {mvar} = {m0}; {mvar} < {m0} + mm; {mvar}++) {{"]
    if local:
        restrict = "" if overwritten else "restrict "
        lines.append(f"      const float *{restrict}{result} = tile;")
    lines.append("      #pragma omp simd")
    lines.append(f"      for (int64_t {nvar} = {n0}; {nvar} < {n0} + {cols}; {nvar}++) {{")
    em = Emitter([{}], [0])
    em.scopes.append({})
    emit_stores(em, epi.passes[0].stores, lines, "        ")
    return [*lines, "      }", "    }"]


def _core(k: GemmKernel, packed_offsets: list[int] | None) -> str:
    if k.own:
        return "opfuse's GEMM on packed panels"
    return "packed weight" if packed_offsets is not None else "sgemm"
