"""Reduction schedules rendered to C: accumulator lanes, OpenMP reduction clauses,
Welford merges, and the rows / split loop structures chosen in lowering (the column
schedules, which share the lane machinery here, are in columns.py). Formatting only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...ir.combine import Family, Identity
from ...ir.index import Var
from ...ir.scalar import Expr
from ...lower.kernel import Accumulate, Kernel, Pass
from .emit import (
    _INT_LIMITS,
    VALUE,
    Emitter,
    emit_stores,
    for_loop,
    gathered,
    index,
    invariant,
    simd_loop,
    stage,
)

LANES = 16  # accumulator lanes per reduction: one 512-bit register of float32
# Welford's updates depend on the previous ones: 64 lanes (8 registers of float64 for the
# mean, 8 for m2) keep enough independent chains in flight to hide the latency.
WELFORD_LANES = 64


ROW_STAGE = 4096  # elements of a row staged whole (16 KiB per float32 operand, on the stack)


def lanes_for(accs: Sequence[Accumulate]) -> int:
    return WELFORD_LANES if any(_welford(a) for a in accs) else LANES


def _welford(a: Accumulate) -> bool:
    return a.row.family is Family.WELFORD


def identity(a: Accumulate) -> str:
    """The C value a fold of `a` starts from."""
    t, ident = a.acc_dtype, a.row.identity
    if ident is Identity.LOWEST:
        return "(-INFINITY)" if t.is_floating_point else _INT_LIMITS[t][0]
    if ident is Identity.HIGHEST:
        return "INFINITY" if t.is_floating_point else _INT_LIMITS[t][1]
    return ident.value


# _mean / _m2 / _cnt, per-thread partials NAME_P.. (split schedule).
def lane_fields(a: Accumulate) -> list[tuple[str, str, str]]:
    """(suffix, C type, initial value) of each lane array."""
    ct = VALUE[a.acc_dtype]
    family = a.row.family
    if family is Family.WELFORD:
        return [("mean", ct, "0"), ("m2", ct, "0")]
    if family is Family.ARGSELECT:
        return [("v", ct, identity(a)), ("i", "int64_t", "INT64_MAX")]
    return [("", ct, identity(a))]


def _results(a: Accumulate) -> list[tuple[str, str]]:
    """(part, C type) of the combined results: a Welford count, then the combine's parts."""
    ct = VALUE[a.acc_dtype]
    count = [("cnt", ct)] if _welford(a) else []
    return count + [(p, "int64_t" if p == "index" else ct) for p in a.row.parts]


def acc_leaf(a: Accumulate, part: str) -> Expr:
    """The Expr("acc") leaf through which later values read result `part` of `a`, with the
    dtype lowering gave it (an argmax's value keeps the compared values' dtype)."""
    dtype = torch.int64 if part == "index" else a.acc_dtype
    if a.row.family is Family.ARGSELECT and part == "value":
        dtype = a.value.dtype
    return Expr("acc", (), dtype, (a.name, part))


def part_suffix(a: Accumulate, part: str) -> str:
    """Array suffix that holds result `part` (lane and partial arrays share suffixes)."""
    if a.row.family is Family.ARGSELECT:
        return "v" if part == "value" else "i"
    return "" if part == "value" else part


def declare_lanes(
    accs: Sequence[Accumulate],
    lines: list[str],
    indent: str,
    lanes: int = LANES,
    used: str | None = None,
) -> None:
    """Lane arrays of `lanes` slots, the first `used` (all by default) set to the identity:
    a columns block of 64 channels sets 64, not 512 (a 2x2 max pool spent as much time
    initialising lanes as reducing)."""
    for a in accs:
        fields = lane_fields(a)
        for suffix, t, _ in fields:
            lines.append(f"{indent}{t} {a.name}_L{suffix}[{lanes}];")
        body = " ".join(f"{a.name}_L{s}[l] = {v};" for s, _, v in fields)
        lines.append(f"{indent}for (int l = 0; l < {used or lanes}; l++) {{ {body} }}")
        if _welford(a):
            t = VALUE[a.acc_dtype]
            lines.append(f"{indent}{t} {a.name}_n = 0;  /* elements in each lane so far */")
            lines.append(f"{indent}{t} {a.name}_tmean = 0, {a.name}_tm2 = 0, {a.name}_tn = 0;")


def _update(a: Accumulate, v: str, lane: str, pos: str, indent: str, tail: bool) -> list[str]:
    n = f"{a.name}_L"
    t = VALUE[a.acc_dtype]
    r = a.row
    if r.family is Family.FOLD:
        return [f"{indent}{n}[{lane}] {r.op}= {v};"]
    if r.family is Family.SELECT:
        if a.acc_dtype.is_floating_point:
            # The new value first: gcc 12 does not vectorise `acc = max(acc, max(x, 0))`
            # (a pooled ReLU: "no vectype for stmt"; 47 ms against 2.3 ms for 8x128x112x112
            # NHWC), but does `max(max(x, 0), acc)`. NaN stays sticky either way.
            return [f"{indent}{n}[{lane}] = op_{r.op}_{t}({v}, {n}[{lane}]);"]
        cmp = "<" if r.op == "max" else ">"
        return [f"{indent}{n}[{lane}] = ({n}[{lane}] {cmp} {v}) ? {v} : {n}[{lane}];"]
    if r.family is Family.ARGSELECT:
        f = f"op_take_{r.op}"
        return [
            f"{indent}{{ const bool tk = {f}_{t}({v}, {pos}, {n}v[{lane}], {n}i[{lane}]);",
            f"{indent}  {n}v[{lane}] = tk ? {v} : {n}v[{lane}];",
            f"{indent}  {n}i[{lane}] = tk ? (int64_t)({pos}) : {n}i[{lane}]; }}",
        ]
    m = a.name
    if tail:  # welford, one element at a time
        return [
            f"{indent}{{ {m}_tn += 1; const {t} d = {v} - {m}_tmean;",
            f"{indent}  {m}_tmean += d / {m}_tn; {m}_tm2 += d * ({v} - {m}_tmean); }}",
        ]
    return [  # welford, every lane has seen NAME_n elements
        f"{indent}{{ const {t} d = {v} - {n}mean[{lane}];",
        f"{indent}  {n}mean[{lane}] += d * {m}_inv;",
        f"{indent}  {n}m2[{lane}] += d * ({v} - {n}mean[{lane}]); }}",
    ]


def merge_step(
    a: Accumulate, src: str, idx: str, lane: bool = False, cnt_idx: str | None = None
) -> str:
    """Fold element `idx` of the arrays named `src`+suffix into the NAME_ results, or with
    `lane` into lane l of the NAME_L.. arrays (a Welford count at `cnt_idx` then)."""
    n, t = a.name, VALUE[a.acc_dtype]

    def dst(part: str) -> str:
        return f"{n}_L{part_suffix(a, part)}[l]" if lane else f"{n}_{part}"

    v, i = dst("value"), dst("index")
    r = a.row
    if r.family is Family.FOLD:
        return f"{v} = {v} {r.op} {src}[{idx}];"
    if r.family is Family.SELECT:
        if a.acc_dtype.is_floating_point:
            return f"{v} = op_{r.op}_{t}({v}, {src}[{idx}]);"
        cmp = "<" if r.op == "max" else ">"
        return f"{v} = ({v} {cmp} {src}[{idx}]) ? {src}[{idx}] : {v};"
    if r.family is Family.ARGSELECT:
        f = f"op_take_{r.op}"
        return (
            f"if ({f}_{t}({src}v[{idx}], {src}i[{idx}], {v}, {i})) "
            f"{{ {v} = {src}v[{idx}]; {i} = {src}i[{idx}]; }}"
        )
    return (
        f"op_welford_merge_{t}(&{dst('cnt')}, &{dst('mean')}, &{dst('m2')}, "
        f"{src}cnt[{cnt_idx or idx}], {src}mean[{idx}], {src}m2[{idx}]);"
    )


def _combine_lanes(
    a: Accumulate, lines: list[str], indent: str, clause: bool = False, lanes: int = LANES
) -> None:
    if clause:
        return  # the pass's reduction clause already combined it into NAME_value
    n = a.name
    if _welford(a):
        t = VALUE[a.acc_dtype]
        lines.append(f"{indent}{t} {n}_cnt = {n}_tn, {n}_mean = {n}_tmean, {n}_m2 = {n}_tm2;")
        lines.append(f"{indent}{t} {n}_Lcnt[{lanes}];")
        lines.append(f"{indent}for (int l = 0; l < {lanes}; l++) {n}_Lcnt[l] = {n}_n;")
        lines.append(f"{indent}for (int l = 0; l < {lanes}; l++) {merge_step(a, n + '_L', 'l')}")
        return
    init = lane_fields(a)
    decl = ", ".join(
        f"{n}_{part} = {init[0][2] if part == 'value' else 'INT64_MAX'}" for part, _ in _results(a)
    )
    types = {t for _, t in _results(a)}
    if len(types) == 1:
        lines.append(f"{indent}{types.pop()} {decl};")
    else:
        for (part, t), text in zip(_results(a), decl.split(", ")):
            lines.append(f"{indent}{t} {text};")
            del part
    lines.append(f"{indent}for (int l = 0; l < {lanes}; l++) {merge_step(a, n + '_L', 'l')}")


def _simple(accs: Sequence[Accumulate]) -> bool:
    """Can OpenMP's reduction clauses do this pass (two-pass variances included)? Then
    the compiler picks the vector width; Welford and argmax/argmin need their own lanes
    (explicit arrays, see _pass_body)."""
    return all(a.row.omp or (_welford(a) and a.algorithm == "two_pass") for a in accs)


def _nan_flag(a: Accumulate) -> bool:
    """Does the pass OR a NaN flag next to the clause (OpenMP's float max/min drop NaN)?"""
    return a.row.family is Family.SELECT and a.acc_dtype.is_floating_point


def _pass_body(
    em: Emitter,
    p: Pass,
    inner: Sequence[Var],
    lines: list[str],
    indent: str,
    split: bool,
    number: int = 0,
) -> None:
    """Loops over the inner domain of one pass; the last inner variable is the vector
    loop. In the split schedule the first inner variable runs over this thread's [lo, hi)."""
    accs = p.accumulates
    if accs and _simple(accs):
        _reduction_clause_pass(em, p, inner, lines, indent, split)
        return
    lanes = lanes_for(accs)
    declare_lanes(accs, lines, indent, lanes)
    # Values that read no memory (reduced results, constants) are computed once per row.
    hoisted = invariant([*(a.value for a in accs), *(s.value for s in p.stores)], inner)
    em.emit(hoisted, lines, indent)
    ind = indent
    last = inner[-1]
    # A last loop shorter than the lanes (GroupNorm over channels-last input: the 4
    # channels of a group) would leave every element to the scalar tail: the lanes then
    # run over the last two loops flattened.
    fold = bool(accs) and len(inner) >= 2 and last.extent < lanes // 4
    loops = inner[:-2] if fold else inner[:-1]
    for i, v in enumerate(loops):
        lo, hi = ("lo", "hi") if split and i == 0 else ("0", str(v.extent))
        lines.append(f"{ind}for (int64_t {v.name} = {lo}; {v.name} < {hi}; {v.name}++) {{")
        ind += "  "
    start, stop = ("lo", "hi") if split and len(inner) == 1 else ("0", str(last.extent))
    if fold:
        _folded_lanes(em, p, inner[-2], last, split and len(inner) == 2, lines, ind, number)
    elif not accs:
        simd_loop(
            em,
            [s.value for s in p.stores],
            last.name,
            (start, stop),
            "simd",
            lines,
            ind,
            lambda body: emit_stores(em, p.stores, lines, body),
        )
    else:
        b = f"{last.name}_b{number}"
        lines.append(f"{ind}int64_t {b} = {start};")
        lines.append(f"{ind}for (; {b} + {lanes} <= {stop}; {b} += {lanes}) {{")
        lane_loop(em, p, lines, ind + "  ", str(lanes), [(last.name, f"{b} + l")], lanes)
        lines.append(f"{ind}}}")
        lines.append(
            f"{ind}for (int64_t {last.name} = {b}; {last.name} < {stop}; {last.name}++) {{"
        )
        em.scopes.append({})
        _accumulate(em, p, lines, ind + "  ", "0", tail=True)
        em.scopes.pop()
        lines.append(f"{ind}}}")
    for _ in loops:
        ind = ind[:-2]
        lines.append(f"{ind}}}")


def _folded_lanes(
    em: Emitter, p: Pass, outer: Var, last: Var, sliced: bool, lines: list[str], ind: str, n: int
) -> None:
    """The lane loop over `outer` x `last` flattened (`outer` over this thread's [lo, hi)
    when `sliced`); the tail runs the leftover flat positions one at a time."""
    lanes = lanes_for(p.accumulates)
    start, stop = ("lo", "hi") if sliced else ("0", str(outer.extent))
    q, count, e = f"{last.name}_q{n}", f"{last.name}_n{n}", last.extent
    lines.append(f"{ind}const int64_t {count} = ({stop} - {start}) * {e};")
    lines.append(f"{ind}int64_t {q} = 0;")
    lines.append(f"{ind}for (; {q} + {lanes} <= {count}; {q} += {lanes}) {{")
    flat = f"({q} + l)"
    lane = [(outer.name, f"{start} + {flat} / {e}"), (last.name, f"{flat} % {e}")]
    lane_loop(em, p, lines, ind + "  ", str(lanes), lane, lanes)
    lines.append(f"{ind}}}")
    lines.append(f"{ind}for (int64_t t = {q}; t < {count}; t++) {{")
    lines.append(f"{ind}  const int64_t {outer.name} = {start} + t / {e}, {last.name} = t % {e};")
    em.scopes.append({})
    _accumulate(em, p, lines, ind + "  ", "0", tail=True)
    em.scopes.pop()
    lines.append(f"{ind}}}")


def _reduction_clause_pass(
    em: Emitter, p: Pass, inner: Sequence[Var], lines: list[str], indent: str, split: bool
) -> None:
    """A pass whose reductions OpenMP combines: `#pragma omp simd reduction(...)` over
    the whole row. Float max/min also OR a NaN flag (OpenMP's max drops NaN). A two-pass
    variance sums the row, then the squared deviations from its mean, in a second loop."""
    clauses = []
    welford = [a for a in p.accumulates if _welford(a)]
    for a in p.accumulates:
        t = VALUE[a.acc_dtype]
        if _welford(a):
            lines.append(f"{indent}{t} {a.name}_sum = 0, {a.name}_m2 = 0;")
            clauses.append(f"reduction(+:{a.name}_sum)")
            continue
        lines.append(f"{indent}{t} {a.name}_value = {identity(a)};")
        if a.block:
            clauses.append(f"reduction(+:{a.name}_run)")
            continue
        clauses.append(f"reduction({a.row.omp}:{a.name}_value)")
        if _nan_flag(a):
            lines.append(f"{indent}int {a.name}_nan = 0;")
            clauses.append(f"reduction(|:{a.name}_nan)")
    hoisted = invariant([*(a.value for a in p.accumulates), *(s.value for s in p.stores)], inner)
    em.emit(hoisted, lines, indent)

    def loop(
        clause: str, body_fn: Any, roots: Sequence[Expr], runs: Sequence[Accumulate] = ()
    ) -> None:
        ind = indent
        for i, v in enumerate(inner[:-1]):
            lo, hi = ("lo", "hi") if split and i == 0 else ("0", str(v.extent))
            lines.append(f"{ind}for (int64_t {v.name} = {lo}; {v.name} < {hi}; {v.name}++) {{")
            ind += "  "
        last = inner[-1]
        start, stop = ("lo", "hi") if split and len(inner) == 1 else ("0", str(last.extent))
        r = last.name
        if runs:  # blocked sums: each run of `block` values folds in value.dtype first
            size = runs[0].block
            lines.append(
                f"{ind}for (int64_t {r}_run = {start}; {r}_run < {stop}; {r}_run += {size}) {{"
            )
            ind += "  "
            end = f"{r}_run + {size}"
            lines.append(f"{ind}const int64_t {r}_end = {end} < {stop} ? {end} : {stop};")
            for a in runs:
                lines.append(f"{ind}{VALUE[a.value.dtype]} {a.name}_run = 0;")
            start, stop = f"{r}_run", f"{r}_end"
        # Only a run (of known length) is staged: see simd_loop's `span`.
        staged_roots, span = (roots, runs[0].block) if runs else ([], None)
        simd_loop(em, staged_roots, r, (start, stop), f"simd {clause}", lines, ind, body_fn, span)
        if runs:
            for a in runs:
                lines.append(f"{ind}{a.name}_value += {a.name}_run;")
            ind = ind[:-2]
            lines.append(f"{ind}}}")
        for _ in inner[:-1]:
            ind = ind[:-2]
            lines.append(f"{ind}}}")

    def first(body: str) -> None:
        em.emit([a.value for a in p.accumulates], lines, body)
        for a in p.accumulates:
            val = em.ref(a.value)
            if _welford(a):
                lines.append(f"{body}{a.name}_sum += {val};")
                continue
            n = f"{a.name}_run" if a.block else f"{a.name}_value"
            if a.row.family is Family.SELECT:
                cmp = ">" if a.row.op == "max" else "<"
                if a.acc_dtype.is_floating_point:
                    lines.append(f"{body}{a.name}_nan |= ({val} != {val});")
                lines.append(f"{body}{n} = ({n} {cmp} {val}) ? {n} : {val};")
            else:
                lines.append(f"{body}{n} {a.row.op}= {val};")
        if not welford:
            emit_stores(em, p.stores, lines, body)

    def second(body: str) -> None:
        em.emit([a.value for a in welford], lines, body)
        for a in welford:
            t = VALUE[a.acc_dtype]
            lines.append(f"{body}{{ const {t} d = {em.ref(a.value)} - {a.name}_mean;")
            lines.append(f"{body}  {a.name}_m2 += d * d; }}")
        emit_stores(em, p.stores, lines, body)

    stored = [s.value for s in p.stores]
    roots = [a.value for a in p.accumulates] + ([] if welford else stored)
    loop(" ".join(clauses), first, roots, [a for a in p.accumulates if a.block])
    count = 1
    for v in inner:
        count *= v.extent
    for a in p.accumulates:
        t = VALUE[a.acc_dtype]
        if _nan_flag(a):
            lines.append(f"{indent}if ({a.name}_nan) {a.name}_value = ({t})NAN;")
        if _welford(a):
            lines.append(
                f"{indent}const {t} {a.name}_cnt = {count}, {a.name}_mean = {a.name}_sum / {count};"
            )
    if welford:
        clause = " ".join(f"reduction(+:{a.name}_m2)" for a in welford)
        loop(clause, second, [a.value for a in welford] + stored)


def lane_loop(
    em: Emitter,
    p: Pass,
    lines: list[str],
    ind: str,
    count: str,
    lane: Sequence[tuple[str, str]],
    size: int,
) -> None:
    """One step of every lane: Welford counts first (shared by the lanes), then a simd loop
    over the (at most `size`) lanes whose body starts by setting each (variable, position)
    of `lane`. Operands the lanes would gather are copied into contiguous arrays first (see
    emit.simd_loop); with two lane variables (folded loops) that is every operand read
    through them."""
    for a in p.accumulates:
        if _welford(a):
            t = VALUE[a.acc_dtype]
            lines.append(f"{ind}{a.name}_n += 1; const {t} {a.name}_inv = 1 / {a.name}_n;")
    var = lane[-1][0]
    header = f"for (int l = 0; l < {count}; l++) {{"
    position = "const int64_t " + ", ".join(f"{v} = {pos}" for v, pos in lane) + ";"
    roots = [*(a.value for a in p.accumulates), *(s.value for s in p.stores)]
    staged = gathered(em, roots, [v for v, _ in lane])
    bound = stage(em, staged, var, (header, position, "l", size), lines, ind) if staged else {}
    lines.append(f"{ind}#pragma omp simd")
    lines.append(f"{ind}{header}")
    lines.append(f"{ind}  {position}")
    em.scopes.append(em.registers(bound, lines, ind + "  "))
    _accumulate(em, p, lines, ind + "  ", "l", tail=False)
    em.scopes.pop()
    lines.append(f"{ind}}}")


def _accumulate(em: Emitter, p: Pass, lines: list[str], ind: str, lane: str, tail: bool) -> None:
    em.emit([a.value for a in p.accumulates], lines, ind)
    for a in p.accumulates:
        pos = index(a.position) if a.position is not None else "0"
        lines.extend(_update(a, em.ref(a.value), lane, pos, ind, tail))
    emit_stores(em, p.stores, lines, ind)


def _publish(em: Emitter, a: Accumulate) -> None:
    """Bind the combined results to the Expr 'acc' leaves that later values read."""
    for part in a.row.parts:
        em.scopes[0][acc_leaf(a, part)] = f"{a.name}_{part}"


def rows(k: Kernel, lines: list[str]) -> None:
    """Each thread reduces whole rows: parallel over the outer (kept) index."""
    indent = "  "
    if k.outer and k.parallel:
        lines.append(
            f"  #pragma omp parallel for collapse({len(k.outer)}) num_threads(nthreads) "
            "schedule(static)"
        )
    for v in k.outer:
        lines.append(for_loop(v, indent))
        indent += "  "
    em = Emitter([{}], [0])
    em.scopes.append({})
    em.scopes.append(_stage_row(em, k, lines, indent))
    for number, p in enumerate(k.passes):
        _pass_body(em, p, k.inner, lines, indent, split=False, number=number)
        for a in p.accumulates:
            _combine_lanes(
                a, lines, indent, clause=_simple(p.accumulates), lanes=lanes_for(p.accumulates)
            )
            _publish(em, a)
        emit_stores(em, p.after, lines, indent)
    em.scopes.pop()
    for _ in k.outer:
        indent = indent[:-2]
        lines.append(f"{indent}}}")


def _stage_row(em: Emitter, k: Kernel, lines: list[str], indent: str) -> dict[Expr, str]:
    """Copy the operands every pass would gather (a LayerNorm whose residual is read
    transposed, as in MLP-Mixer's token mixing) into contiguous arrays once per row, when a
    row fits ROW_STAGE: the passes (statistics, then normalise) then all read unit stride,
    where before only the last one staged and the reduction loops gathered (OpenMP
    reductions cannot be staged per chunk, see emit.simd_loop). Mixer LayerNorm(x +
    t.transpose(1, 2)) over 16x64x256: 0.54 -> 0.20 ms."""
    if len(k.inner) != 1 or k.inner[0].extent > ROW_STAGE:
        return {}
    v = k.inner[0]
    roots = [e for p in k.passes for e in p.values]
    # Only what no pass writes: a value a pass stores and a later pass reads back (softmax's
    # exp, kept in an output laid out across the row) would be copied before it exists.
    written = {b.name for b in k.outputs}
    loads = [e for e in gathered(em, roots, [v.name]) if e.value[0] not in written]
    if not loads:
        return {}
    header = f"for (int64_t {v.name} = 0; {v.name} < {v.extent}; {v.name}++) {{"
    return stage(em, loads, f"{v.name}_row", (header, None, v.name, v.extent), lines, indent)


def split(k: Kernel, lines: list[str]) -> None:
    """Few, long rows: all threads share each row and combine partial results."""
    accs = [a for p in k.passes for a in p.accumulates]
    for a in accs:  # partials live outside the parallel region: shared by the threads
        for part, t in _results(a):
            lines.append(f"  {t} {a.name}_P{part_suffix(a, part)}[nthreads > 0 ? nthreads : 1];")
    align = max(lanes_for(p.accumulates) for p in k.passes) if len(k.inner) == 1 else 1
    thread_slices(lines, k.inner[0].extent, align)
    indent = "    "
    for v in k.outer:
        lines.append(for_loop(v, indent))
        indent += "  "
    em = Emitter([{}], [0])
    em.scopes.append({})
    for number, p in enumerate(k.passes):
        _pass_body(em, p, k.inner, lines, indent, split=True, number=number)
        for a in p.accumulates:
            _combine_lanes(
                a, lines, indent, clause=_simple(p.accumulates), lanes=lanes_for(p.accumulates)
            )
            for part, _ in _results(a):
                lines.append(f"{indent}{a.name}_P{part_suffix(a, part)}[tid] = {a.name}_{part};")
        if p.accumulates:
            lines.append(f"{indent}#pragma omp barrier")
        for a in p.accumulates:
            reset = "; ".join(
                f"{a.name}_{part} = {_reset_value(a, part)}" for part, _ in _results(a)
            )
            lines.append(f"{indent}{reset};")
            lines.append(
                f"{indent}for (int q = 0; q < nt; q++) {merge_step(a, a.name + '_P', 'q')}"
            )
            _publish(em, a)
        if p.accumulates:
            # Nobody may overwrite the partials (next row or pass) before all have read them.
            lines.append(f"{indent}#pragma omp barrier")
        if p.after:
            lines.append(f"{indent}if (tid == 0) {{")
            em.scopes.append({})
            emit_stores(em, p.after, lines, indent + "  ")
            em.scopes.pop()
            lines.append(f"{indent}}}")
    for _ in k.outer:
        indent = indent[:-2]
        lines.append(f"{indent}}}")
    lines.append("  }")


def _reset_value(a: Accumulate, part: str) -> str:
    if part in ("cnt", "mean", "m2"):
        return "0"
    if part == "index":
        return "INT64_MAX"
    return identity(a)


def thread_slices(lines: list[str], ext: int, align: int) -> None:
    """Open the parallel region of the split schedules: thread `tid` of `nt` takes [lo, hi)
    of `ext`, slices a multiple of `align` long (whole vector lane groups)."""
    lines.append("  #pragma omp parallel num_threads(nthreads)")
    lines.append("  {")
    lines.append("    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();")
    chunk = f"({ext} + nt - 1) / nt"
    if align > 1:
        chunk = f"({chunk} + {align - 1}) / {align} * {align}"
    lines.append(f"    const int64_t chunk = {chunk};")
    lines.append(f"    const int64_t lo = tid * chunk < {ext} ? tid * chunk : {ext};")
    lines.append(f"    const int64_t hi = lo + chunk < {ext} ? lo + chunk : {ext};")
