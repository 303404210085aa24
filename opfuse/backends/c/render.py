"""Kernel -> C source with OpenMP. Formatting only: every semantic choice was made in
lowering; formulas come from the primitive table (ir.scalar.PRIMS) and conversions from
emit.py. Reduction schedules: rows and split in reductions.py, columns and columns_split in
columns.py.

Each kernel becomes `int NAME(void *const *args, int nthreads)` returning 0, or 1 when an
integer division by zero happened (torch raises ZeroDivisionError there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ...lower.kernel import PARALLEL_MIN, Kernel, Piece, Schedule, Store
from ..common import traffic
from .columns import columns
from .emit import STORAGE, Emitter, emit_checks, emit_stores, for_loop, invariant, simd_loop
from .reductions import rows, split


def render_module(kernels: Sequence[tuple[str, Kernel]]) -> str:
    """One translation unit holding every kernel of a graph (the builder prepends the
    prelude that fits its toolchain, see prelude.py)."""
    return "\n".join(render_kernel(name, k) for name, k in kernels)


def _header(name: str, k: Kernel) -> list[str]:
    ops = ", ".join(dict.fromkeys(k.ops))
    cases = f"; as {len(k.cases)} cases of {k.notes['cases']}" if k.cases else ""
    cases += "".join(f"; {k.notes[n]}" for n in ("rows", "unrolled") if n in k.notes)
    return [
        f"/* {k.name}: {ops}",
        f" * schedule {k.schedule}; {traffic(k)}{cases} */",
        f"int {name}(void *const *args, int nthreads) {{",
    ]


def render_kernel(name: str, k: Kernel) -> str:
    lines = _header(name, k)
    shared = {name for pair in k.inplace for name in pair}  # may alias: no restrict
    for i, b in enumerate(k.buffers):
        const = "const " if b.role == "in" else ""
        t = STORAGE[b.dtype]
        if b.name in shared:
            lines.append(f"  {const}{t} *{b.name} = ({const}{t} *)args[{i}];")
            continue
        lines.append(f"  {const}{t} *restrict {b.name} = ({const}{t} *)args[{i}];")
    lines.append("  int err = 0;")
    lines.append("  (void)nthreads;")
    if not k.cases:
        _body(k, lines)
    for case in k.cases:  # one block each: their declarations must not meet
        lines.append("  {")
        _body(case, lines)
        lines.append("  }")
    lines.append("  return err;")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _body(k: Kernel, lines: list[str]) -> None:
    if not k.parallel_at_run_time:
        _schedule(k, lines)
        return
    # sizes known only when it runs: threads or not, chosen then
    lines.append(f"  if ({k.work} >= {PARALLEL_MIN}) {{")
    _schedule(replace(k, threads=True), lines)
    lines.append("  } else {")
    _schedule(replace(k, threads=False), lines)
    lines.append("  }")


def _schedule(k: Kernel, lines: list[str]) -> None:
    if k.schedule is Schedule.POINTWISE:
        _pointwise(k, lines)
    elif k.schedule is Schedule.ROWS:
        rows(k, lines)
    elif k.schedule.columns:
        columns(k, lines, split=k.schedule is Schedule.COLUMNS_SPLIT)
    else:
        split(k, lines)


def _pointwise(k: Kernel, lines: list[str]) -> None:
    p = k.passes[0]
    red = " reduction(|:err)" if k.checks else ""
    em = Emitter([{}], [0])
    if not k.outer:
        emit_stores(em, p.stores, lines, "  ")
        emit_checks(em, k, lines, "  ")
        return
    # A parallel region whose if() clause is false is not vectorised by gcc: small kernels
    # get no parallel construct at all.
    par = f"num_threads(nthreads) schedule(static){red}"
    if len(k.outer) == 1:
        pragma = f"parallel for simd {par}" if k.parallel else f"simd{red}"
        lines.append(f"  #pragma omp {pragma}")
    elif k.parallel:
        lines.append(f"  #pragma omp parallel for collapse({len(k.outer) - 1}) {par}")
    indent = "  "

    def body(ind: str) -> None:
        emit_stores(em, p.stores, lines, ind)
        emit_checks(em, k, lines, ind)

    if len(k.outer) == 1:
        lines.append(for_loop(k.outer[0], indent))
        em.scopes.append({})
        body(indent + "  ")
        lines.append(f"{indent}}}")
        return
    *rest, v = k.outer
    for u in rest:
        lines.append(for_loop(u, indent))
        indent += "  "
    # what the vector loop does not change is computed before it; a loop cut into pieces
    # (lower/split.py) runs each piece with its own stores, its variable offset in them
    for piece in k.pieces or (Piece(0, v, p.stores),):
        em.scopes.append({})
        roots = [s.value for s in piece.stores]
        em.emit(invariant(roots, [piece.var]), lines, indent)

        def run(ind: str, stores: tuple[Store, ...] = piece.stores) -> None:
            emit_stores(em, stores, lines, ind)
            emit_checks(em, k, lines, ind)

        bounds = ("0", str(piece.var.extent))
        simd_loop(em, [*roots, *k.checks], v.name, bounds, f"simd{red}", lines, indent, run)
        em.scopes.pop()
    for _ in rest:
        indent = indent[:-2]
        lines.append(f"{indent}}}")


# -- reductions ----------------------------------------------------------------------------
# Naming: lane arrays NAME_L.. (one slot per lane), combined results NAME_value / _index /
