"""Tiling a pointwise kernel that writes along one dimension and reads along another.

A transposing copy (`x.t().contiguous()`, [B, T, C] -> [B, C, T] between a linear and a
Conv1d, NCHW <-> NHWC) writes its output contiguously along the vector loop's variable and
reads a large input a whole row apart at every step of it: every load is a new cache line
and, rows 4 KiB and more apart, a new page. Walked in TILE x TILE squares instead (the
input's contiguous variable outside the vector loop, inside the tile), each line the
square touches is read once and stays in L1 while the other TILE - 1 steps use it
(4096x1024 transposed and scaled: eager 14.9 ms, untiled 16.7 ms, tiled 4.1 ms).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from ..ir.index import Ix, Var
from ..ir.size import is_size
from .kernel import Kernel, Schedule, map_indices
from .unswitch import case

TILE = 16  # floats per 64-byte line: one vector of stores, one line per load row
MIN_INPUT_BYTES = 1 << 20  # smaller inputs stay in L2 untiled (measured: 96x128x64 is fine)


def tile_transposes(k: Kernel, accesses: list[tuple[str, Ix]]) -> Kernel:
    """`k` walked in tiles when its vector variable reads a large input across lines and
    another variable reads it along them; `k` itself otherwise. `accesses` are k's
    (buffer, index) reads, stores and position tests. Kernels with gathers keep their
    loops (the vector loop's cuts at a gather's edges need its variable whole)."""
    if k.schedule is not Schedule.POINTWISE or len(k.outer) < 2 or k.checks:
        return k
    if not all(ix.is_affine() for _, ix in accesses):
        return k
    vec = k.outer[-1]
    if any(is_size(v.extent) for v in k.outer):
        # symbolic sizes: one untiled source for every size, where the input's size (tiled
        # from 1 MiB) would decide, and the extents' remainders would differ
        return k
    sizes = {b.name: b.nbytes for b in k.buffers if b.role == "in"}
    best: tuple[int, Var] | None = None
    for buf, ix in accesses:
        if sizes.get(buf, 0) < MIN_INPUT_BYTES:
            continue
        if abs(ix.coef(vec)) < TILE:
            continue
        along = [v for v in k.outer[:-1] if abs(ix.coef(v)) == 1]
        if along and (best is None or sizes[buf] > best[0]):
            best = (sizes[buf], along[0])
    if best is None:
        return k
    row = best[1]
    if vec.extent < 2 * TILE or row.extent < 2 * TILE:
        return k
    if not (vec.extent % TILE or row.extent % TILE):
        return _tiled(k, row, vec)
    # The whole squares tiled, the rows and columns past them as they were (ViT's
    # [197, 768] -> [768, 197] per image: 0.60 -> 0.15 ms at batch 8); cases run in turn.
    rm, vm = row.extent - row.extent % TILE, vec.extent - vec.extent % TILE
    rows = case(k, row, 0, rm)
    main = case(rows, _named(rows, vec), 0, vm)
    cases = [_tiled(main, _named(main, row), _named(main, vec))]
    if vm < vec.extent:
        cases.append(case(rows, _named(rows, vec), vm, vec.extent))
    if rm < row.extent:
        cases.append(case(k, row, rm, row.extent))
    cut = f"{row.name} x {vec.name} in squares of {TILE}, the rest untiled"
    return replace(k, cases=tuple(cases), notes={**k.notes, "cases": cut})


def _named(k: Kernel, v: Var) -> Var:
    """k's outer variable named as v (a case's has its own extent)."""
    return next(u for u in k.outer if u.name == v.name)


def _tiled(k: Kernel, row: Var, vec: Var) -> Kernel:
    """k walked in TILE x TILE squares of row and vec (both whole multiples of TILE)."""
    r_hi, r_lo = Var(f"{row.name}t", row.extent // TILE), Var(f"{row.name}u", TILE)
    v_hi, v_lo = Var(f"{vec.name}t", vec.extent // TILE), Var(f"{vec.name}u", TILE)
    env = {row: Ix.var(r_hi) * TILE + Ix.var(r_lo), vec: Ix.var(v_hi) * TILE + Ix.var(v_lo)}
    rest = tuple(v for v in k.outer[:-1] if v != row)
    k = map_indices(k, partial(Ix.substitute, env=env))
    # Tiles along the input's rows outermost: the input is read row block by row block
    # (16 pages at a time), the output written a line per row. The other order read every
    # input page once per column block: 4096x1024 transposed 6.6 ms, this order 4.1 ms.
    return replace(k, outer=(*rest, v_hi, r_hi, r_lo, v_lo))
