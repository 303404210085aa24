"""The column schedules rendered to C: lanes are neighbouring outputs (the kept dimension
memory walks contiguously), each reducing its own column; columns_split shares the rows
among the threads and merges their lanes. Formatting only."""

from __future__ import annotations

from collections.abc import Sequence

from ...ir.combine import Family
from ...lower.kernel import Accumulate, Kernel
from ...lower.schedule import COLUMN_LANES
from .emit import VALUE, Emitter, emit_stores, for_loop
from .reductions import (
    acc_leaf,
    declare_lanes,
    lane_fields,
    lane_loop,
    merge_step,
    part_suffix,
    thread_slices,
)


def columns(k: Kernel, lines: list[str], split: bool = False) -> None:
    """Lanes are neighbouring outputs: the kept dimension memory walks contiguously (the
    last outer variable) is cut into blocks of COLUMN_LANES; every lane reduces its own
    column. Split: all threads work on each block, each over its slice of the first reduced
    variable; they publish their lanes, and every thread merges all of them (the passes
    after need the results) between two barriers."""
    *rest, vec = k.outer
    blocks = (vec.extent + COLUMN_LANES - 1) // COLUMN_LANES
    indent = "  "
    if split:
        _open_split_region(k, lines, k.inner[0].extent, COLUMN_LANES)
        indent = "    "
    elif k.parallel:
        lines.append(
            f"  #pragma omp parallel for collapse({len(rest) + 1}) num_threads(nthreads) "
            "schedule(static)"
        )
    for v in rest:
        lines.append(for_loop(v, indent))
        indent += "  "
    blk = f"{vec.name}_blk"
    lines.append(f"{indent}for (int64_t {blk} = 0; {blk} < {blocks}; {blk}++) {{")
    indent += "  "
    left = f"{vec.extent} - {blk} * {COLUMN_LANES}"
    lines.append(f"{indent}const int64_t nl = {left} < {COLUMN_LANES} ? {left} : {COLUMN_LANES};")
    lane = [(vec.name, f"{vec.name}_blk * {COLUMN_LANES} + l")]
    em = Emitter([{}], [0])
    for p in k.passes:
        declare_lanes(p.accumulates, lines, indent, COLUMN_LANES, "nl")
        ind = indent
        for i, v in enumerate(k.inner):
            lo, hi = ("lo", "hi") if split and i == 0 else ("0", str(v.extent))
            lines.append(f"{ind}for (int64_t {v.name} = {lo}; {v.name} < {hi}; {v.name}++) {{")
            ind += "  "
        lane_loop(em, p, lines, ind, "nl", lane, COLUMN_LANES)
        for _ in k.inner:
            ind = ind[:-2]
            lines.append(f"{ind}}}")
        if split and p.accumulates:
            _merge_column_lanes(p.accumulates, lines, indent)
        for a in p.accumulates:
            # each lane's array slot is already that column's result
            for part in a.row.parts:
                em.scopes[0][acc_leaf(a, part)] = f"{a.name}_L{part_suffix(a, part)}[l]"
        if p.after:
            ind = indent
            if split:  # one thread writes the per-column results
                lines.append(f"{indent}if (tid == 0) {{")
                ind += "  "
            lines.append(f"{ind}#pragma omp simd")
            lines.append(f"{ind}for (int l = 0; l < nl; l++) {{")
            lines.append(f"{ind}  const int64_t {lane[0][0]} = {lane[0][1]};")
            em.scopes.append({})
            emit_stores(em, p.after, lines, ind + "  ")
            em.scopes.pop()
            lines.append(f"{ind}}}")
            if split:
                lines.append(f"{indent}}}")
    lines.append(f"{indent[:-2]}}}")
    indent = indent[:-2]
    for _ in rest:
        indent = indent[:-2]
        lines.append(f"{indent}}}")
    if split:
        lines.append("  }")


def _open_split_region(k: Kernel, lines: list[str], ext: int, width: int) -> None:
    """Partial arrays (shared, `width` lanes per thread), then the parallel region with
    this thread's [lo, hi) of the first reduced variable."""
    for p in k.passes:
        for a in p.accumulates:
            for suffix, t, _ in lane_fields(a):
                lines.append(f"  {t} {a.name}_P{suffix}[(nthreads > 0 ? nthreads : 1) * {width}];")
            if a.row.family is Family.WELFORD:
                t = VALUE[a.acc_dtype]
                lines.append(f"  {t} {a.name}_Pcnt[nthreads > 0 ? nthreads : 1];")
    thread_slices(lines, ext, 1)


def _merge_column_lanes(accs: Sequence[Accumulate], lines: list[str], ind: str) -> None:
    """Publish this thread's lanes, wait, fold every thread's lanes into ours, wait (no
    thread may overwrite the partials before all have read them)."""
    w = COLUMN_LANES
    for a in accs:
        copy = " ".join(
            f"{a.name}_P{s}[tid * {w} + l] = {a.name}_L{s}[l];" for s, _, _ in lane_fields(a)
        )
        lines.append(f"{ind}for (int l = 0; l < nl; l++) {{ {copy} }}")
        if a.row.family is Family.WELFORD:
            lines.append(f"{ind}{a.name}_Pcnt[tid] = {a.name}_n;")
    lines.append(f"{ind}#pragma omp barrier")
    for a in accs:
        t = VALUE[a.acc_dtype]
        reset = " ".join(f"{a.name}_L{s}[l] = {v};" for s, _, v in lane_fields(a))
        if a.row.family is Family.WELFORD:
            lines.append(f"{ind}{t} {a.name}_Lcnt[{w}];")
            reset += f" {a.name}_Lcnt[l] = 0;"
        lines.append(f"{ind}for (int l = 0; l < nl; l++) {{ {reset} }}")
        lines.append(f"{ind}for (int q = 0; q < nt; q++)")
        step = merge_step(a, f"{a.name}_P", f"q * {w} + l", lane=True, cnt_idx="q")
        lines.append(f"{ind}  for (int l = 0; l < nl; l++) {step}")
    lines.append(f"{ind}#pragma omp barrier")
