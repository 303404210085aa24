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
from .kernel import Kernel, Schedule, map_indices

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
    if vec.extent % TILE or row.extent % TILE or vec.extent < 2 * TILE or row.extent < 2 * TILE:
        return k
    r_hi, r_lo = Var(f"{row.name}t", row.extent // TILE), Var(f"{row.name}u", TILE)
    v_hi, v_lo = Var(f"{vec.name}t", vec.extent // TILE), Var(f"{vec.name}u", TILE)
    env = {row: Ix.var(r_hi) * TILE + Ix.var(r_lo), vec: Ix.var(v_hi) * TILE + Ix.var(v_lo)}
    rest = tuple(v for v in k.outer[:-1] if v != row)
    k = map_indices(k, partial(Ix.substitute, env=env))
    # Tiles along the input's rows outermost: the input is read row block by row block
    # (16 pages at a time), the output written a line per row. The other order read every
    # input page once per column block: 4096x1024 transposed 6.6 ms, this order 4.1 ms.
    return replace(k, outer=(*rest, v_hi, r_hi, r_lo, v_lo))
