"""Tile sizes of a tiled GEMM (lower/epilogue.GemmKernel): how many rows and columns each
tile takes, for MKL's packed GEMM and for opfuse's own, and how many tile slots its scratch
holds. At symbolic sizes (ir/size.py) the tiles are expressions the kernel computes as it
runs, so that no size decides where the tiling allows it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..ir.size import at_least, either, gcd, is_size
from ..tools.caches import l1_bytes, l2_bytes

if TYPE_CHECKING:
    from .epilogue import GemmSpec


def tile_slots(n_tiles: int, threads: int) -> int:
    """Tile slots in a tiled kernel's scratch, one per thread that may run (the kernel runs
    on no more): a slot for every thread this machine has, in case the caller raises the
    thread count after compiling, and never more slots than tiles: a symbolic tile count
    as an expression, the fewer of the two as the kernel runs (no tile count decides)."""
    most = max(threads, os.cpu_count() or 1)
    if is_size(n_tiles):
        return either(at_least(n_tiles, most), most, n_tiles)
    return min(most, n_tiles)


def whole_rounds(m: int, tm: int, n_cols: int, threads: int) -> int:
    """Rows per tile so that the tiles (n_cols to a row of tiles) come in whole rounds of
    `threads`: a count the threads do not divide leaves one thread a tile more than the
    others (ViT-B's MLP, 1576 rows: 15 tiles of 112 on 2 threads, 8 and 7)."""
    n_rows = -(-m // tm)
    if (n_rows * n_cols) % threads and n_rows > 1:
        rounds = -(-(n_rows * n_cols) // threads)
        tm = -(-m // -(-(threads * rounds) // n_cols))  # more, shorter rows of tiles
    return tm


def even_tiles(m: int, cap: int, threads: int) -> int:
    """Rows per tile: the fewest tiles of at most `cap` rows that come in whole rounds of
    `threads`, all of one height (whole_rounds' result, or tiles more even), as one
    expression of m: with symbolic sizes (ir/size.py) every m prints the same tile."""
    pieces = threads * -(-m // (threads * cap))
    return -(-m // pieces)


TILE_MAX_ELEMENTS = 1 << 19  # 2 MB of float32: a tile and its epilogue stay in L2
OWN_PANEL = 32  # the columns of a panel of B packed for opfuse's GEMM (backends/c/own_gemm.py)


def tiles(spec: GemmSpec, threads: int, epilogue: bool = True, panel: int = 64) -> tuple[int, int]:
    """Tile sizes, measured on MKL's packed GEMM: one tile per thread where that keeps
    tiles at least 128 rows tall (splitting columns when rows are few: a short, wide tile
    keeps the library at full speed), then narrower (down to 512 columns), then shorter
    tiles while an epilogue's tile would not fit in cache. Columns go first: each row of
    tiles streams the whole weight again, each column of tiles only its block of it (ViT-B's
    MLP, 1576x768x3072: 15 tiles of 112x3072 cost the epilogue +32% over the bare GEMM,
    16 of 788x384 +2%). Columns are split in multiples of `panel`: 64 for MKL, opfuse's
    GEMM its panels of 32 (OWN_PANEL), so the threads get equal shares (672 columns: 11
    and 10 panels, where multiples of 64 gave 12 and 9)."""
    m, n = spec.m, spec.n
    if spec.batch >= threads:
        return m, n
    if is_size(m) and not is_size(spec.batch):
        return _tiles_any_rows(spec, threads, epilogue, panel)
    split_rows = m >= 128 * threads
    if split_rows:
        tm, tn = -(-m // threads), n
    else:
        tm = m
        tn = _round_up(-(-n // threads), panel)
    if epilogue and split_rows and is_size(m):
        # Rows split at a symbolic size: whole rounds of tiles of at most the rows that
        # fit, in 16s, as one expression of m (halving the columns as m grows, as below,
        # made a new source at every doubling of m). BERT-base at 384 and 512 tokens, all
        # its GEMMs tiled this way: 1.002x and 1.006x the time of the columns halved.
        return min(_fitting_rows(m, tn, threads), m), tn
    if epilogue:
        tn = _narrowed(tn, tm)
        if tm * tn > TILE_MAX_ELEMENTS and tm > 128:
            # the fewest equal pieces of at most 3/4 of the cap (what halving until it
            # fit gave on average), as one expression of m: with symbolic sizes
            # (ir/size.py) every m of this regime prints the same tile, where halving
            # printed one more step per doubling of m, at thresholds each layer has its own
            fit = max(128, TILE_MAX_ELEMENTS * 3 // 4 // tn // 16 * 16)
            pieces = -(-tm // fit)
            tm = _round_up(-(-tm // pieces), 16)
    tm = whole_rounds(m, tm, -(-n // tn), threads)
    return min(tm, m), min(tn, n)


def _tiles_any_rows(spec: GemmSpec, threads: int, epilogue: bool, panel: int) -> tuple[int, int]:
    """`tiles` at a symbolic row count m, as expressions the kernel computes when it runs,
    so that no row count decides: MKL's packed weight is packed per column tile, so the
    columns split one way for every m, as `tiles` splits them for few rows; the rows then
    in the fewest tiles that fit in cache and come in whole rounds of the threads."""
    m, n = spec.m, spec.n
    tn = _round_up(-(-n // threads), panel)
    if epilogue:  # the widest tile `tiles` gives below 128 rows a thread
        tn = _narrowed(tn, 128 * threads - 1)
    n_cols = -(-n // tn)
    rounds = threads // gcd(threads, n_cols)  # row tiles to a round of the threads
    if not epilogue:  # the tiles are computed in the output: one round of the threads
        return -(-m // rounds), tn
    return _fitting_rows(m, tn, rounds), tn


def own_tiles(spec: GemmSpec, threads: int, epilogue: bool = True) -> tuple[int, int]:
    """Tiles for opfuse's GEMM: `tiles`, columns split in its panels of 32; but a matrix of
    few rows, whose threads would share its columns, splits its rows instead where one
    thread's A would not stay in L1 and B, a frozen weight (packed once: a B the kernel
    packs, every thread would pack whole), fits in L2. The GEMM walks a tile panel by
    panel over all the tile's rows: half the rows halve what each panel reads again, and
    the whole of B is cheap to read twice. Alone, row tiles against column tiles: 196x112x672
    0.94x the time, 196x672x112 0.90x, 196x480x80 0.72x (80 columns split 64 and 16),
    49x960x160 0.91x; 49x160x960, whose A stays in L1, 1.07x (kept as columns); ResNet's
    196x1024x256 and 196x256x1024 (B of 1 MiB) 0.99x."""
    if is_size(spec.m) and not is_size(spec.batch) and spec.batch < threads:
        return _own_tiles_any_rows(spec, threads, epilogue)
    tm, tn = tiles(spec, threads, epilogue, OWN_PANEL)
    m, n, k = spec.m, spec.n, spec.k
    rows = -(-m // threads)
    if (
        spec.batch == 1
        and spec.packable
        and tm == m
        and tn < n
        and 4 * m * k > l1_bytes()
        and 4 * k * n <= l2_bytes()
        and rows * n <= TILE_MAX_ELEMENTS
    ):
        return rows, n
    return tm, tn


def _own_tiles_any_rows(spec: GemmSpec, threads: int, epilogue: bool) -> tuple[int, int]:
    """own_tiles at a symbolic row count m as expressions the kernel computes when it runs
    (its packed weight is one layout for every tiling, backends/c/gemm.OwnPack), so
    that no row count decides and one compile serves them all: the rows split from 128
    rows per thread, as `tiles` takes it; below that the small-weight rows split where
    own_tiles takes it, else the columns split, its tiles sized for the most rows below."""
    m, n, k = spec.m, spec.n, spec.k
    bound = 128 * threads
    full = n  # the rows split's columns: all, or (a vocabulary) blocks of them that fit
    if epilogue:  # whole rounds of at most the rows whose tile fits in cache, in 16s
        full = _narrowed(full, 128)
        tall = _fitting_rows(m, full, threads)
    else:
        tall = -(-m // threads)
    tn = _round_up(-(-n // threads), OWN_PANEL)
    wide = m
    if epilogue:
        tn = _narrowed(tn, bound - 1)
        if (bound - 1) * tn > TILE_MAX_ELEMENTS:  # (many threads) rows in pieces that fit
            fit = max(128, TILE_MAX_ELEMENTS * 3 // 4 // tn // 16 * 16)
            wide = _round_up(-(-m // (m // fit + 1)), 16)
    low_m, low_n = wide, tn
    if (
        spec.batch == 1
        and spec.packable
        and tn < n
        and 4 * k * n <= l2_bytes()
        and 128 * n <= TILE_MAX_ELEMENTS
    ):  # own_tiles' rows split where one thread's A would not stay in L1
        few = at_least(m, l1_bytes() // (4 * k) + 1)
        low_m, low_n = either(few, -(-m // threads), wide), either(few, n, tn)
    high = at_least(m, bound)
    return either(high, tall, low_m), either(high, full, low_n)


def _narrowed(tn: int, rows: int) -> int:
    """The columns of a tile `rows` tall, halved (in 64s, down to 512) while the tile
    would not fit the cache cap."""
    while rows * tn > TILE_MAX_ELEMENTS and tn > 512:
        tn = _round_up(tn // 2, 64)
    return tn


def _fitting_rows(m: int, tn: int, rounds: int) -> int:
    """Rows per tile of `tn` columns: the fewest tiles of at most the rows that fit the
    cache cap (at least 128), in whole rounds of `rounds`, in 16s, as one expression of m."""
    fit = max(128, TILE_MAX_ELEMENTS // tn // 16 * 16)
    return _round_up(even_tiles(m, fit, rounds), 16)


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k
