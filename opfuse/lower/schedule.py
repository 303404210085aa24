"""Loop order, loop merging and the parallel schedule of a lowered kernel.

Dimensions are ordered so that the innermost loop walks the primary access (the first
output of a pointwise kernel, the largest input of a reduction) with the smallest stride;
then adjacent dimensions are merged wherever every access walks them as one, e.g. a
contiguous [64, 768] elementwise kernel becomes one loop of 49152 iterations. Loop
variables are then renamed x0.. (outer, parallel) and r0.. (inner, reduced).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..ir.combine import Family
from ..ir.index import Clamp, Ix, Var
from ..ir.scalar import Expr, walk
from .kernel import Kernel, Schedule, map_indices
from .refine import refine
from .split import with_pieces
from .tile import tile_transposes
from .unroll import unroll_short_vector, write_out_short_rows
from .unswitch import unswitch

# A reduction whose rows are too few to keep every thread busy splits each row.
SPLIT_MAX_OUTER = 16
SPLIT_MIN_INNER = 1 << 15
COLUMN_LANES = 512  # outputs per block in the columns schedules (measured: 64 to 512)
CACHE_LINE = 64
WINDOW_MAX = 256  # reduced elements per output of a pooling window in the columns schedule
WINDOW_RUN = 8  # ... whose contiguous runs are shorter than this
SPLIT_MIN_SLICES = 8  # a split schedule's threads share the first reduced variable
SPLIT_SHARED_LINES_MIN_INNER = 2048


def accesses(k: Kernel) -> list[tuple[str, Ix]]:
    out: list[tuple[str, Ix]] = []
    roots: list[Expr] = []
    for p in k.passes:
        roots.extend(p.values)
        out.extend((s.buffer, s.index) for s in (*p.stores, *p.after))
        out.extend(("<guard>", s.guard) for s in (*p.stores, *p.after) if s.guard is not None)
        out.extend(("<position>", a.position) for a in p.accumulates if a.position is not None)
    for e in walk(roots):
        if e.op == "load":
            out.append(e.value)
        elif e.op == "index":
            out.append(("<position>", e.value))
    return out


def _blocked(ixs: Sequence[Ix]) -> set[Var]:
    """Variables used inside div/mod: they keep their own loop."""
    out: set[Var] = set()
    for ix in ixs:
        for atom, _ in ix.terms:
            if not isinstance(atom, Var):
                out |= atom.x.variables()
    return out


def _mergeable(group: list[Var], v: Var, ixs: Sequence[Ix]) -> bool:
    inner = group[-1]
    return all(ix.coef(inner) == ix.coef(v) * v.extent for ix in ixs)


def _store_indices(k: Kernel) -> list[Ix]:
    return [s.index for p in k.passes for s in (*p.stores, *p.after)]


def finalize(k: Kernel) -> Kernel:
    stores = _store_indices(k)
    k = refine(k, [ix for _, ix in accesses(k)], stores)
    ixs = [ix for _, ix in accesses(k)]
    outs = k.outputs
    primary_store: Ix | None = None
    for p in k.passes:
        for s in (*p.stores, *p.after):
            if outs and s.buffer == outs[0].name:
                primary_store = s.index
    primary_outer = primary_store
    primary_inner = _largest_stream(k)
    outer_groups = _groups(k.outer, ixs, primary_outer)
    inner_groups = _groups(k.inner, ixs, primary_inner if k.inner else None)
    rename: dict[Var, tuple[Var, int]] = {}  # old var -> (new var, coefficient scale)
    new_outer = _name_groups(outer_groups, "x", rename)
    new_inner = _name_groups(inner_groups, "r", rename)
    if not new_inner and any(p.accumulates for p in k.passes):
        new_inner = [Var("r0", 1)]  # reducing only size-1 dims: one element per row

    def fix(ix: Ix) -> Ix:
        return rewrite_ix(ix, rename)

    k2 = replace(map_indices(k, fix), outer=tuple(new_outer), inner=tuple(new_inner))
    k2 = write_out_short_rows(replace(k2, schedule=_choose(k2)))
    k2 = replace(k2, inplace=inplace_pairs(k2))
    k2 = unswitch(k2)
    if k2.cases:  # the cases run, the whole kernel is only their description
        done = [_finish(c) for c in k2.cases]
        return replace(k2, cases=tuple(x for c in done for x in (c.cases or (c,))))
    return _finish(k2)


def _finish(k: Kernel) -> Kernel:
    k = tile_transposes(unroll_short_vector(k), accesses(k))
    if k.cases:  # tiled squares and the rest (tile.py)
        return replace(k, cases=tuple(with_pieces(_variance_algorithm(c)) for c in k.cases))
    return with_pieces(_variance_algorithm(k))


def inplace_pairs(k: Kernel) -> tuple[tuple[str, str], ...]:
    """Outputs that may overwrite an input: same dtype and layout; every load of the input
    at the very index the output is stored at; no load of it in a pass after the store."""
    loads: dict[str, set[Ix]] = {}
    last_load: dict[str, int] = {}
    stores: dict[str, list[tuple[int, Ix, bool]]] = {}
    for p_i, p in enumerate(k.passes):
        roots = p.values
        if p_i == 0:
            roots += list(k.checks)
        for e in walk(roots):
            if e.op == "load":
                buf, ix = e.value
                loads.setdefault(buf, set()).add(ix)
                last_load[buf] = max(last_load.get(buf, -1), p_i)
        for s in p.stores:
            stores.setdefault(s.buffer, []).append((p_i, s.index, s.guard is None))
        for s in p.after:
            stores.setdefault(s.buffer, []).append((p_i, s.index, False))
    pairs = []
    taken: set[str] = set()
    for out in k.outputs:
        sts = stores.get(out.name, [])
        if not sts or not all(ok for _, _, ok in sts) or len({ix for _, ix, _ in sts}) != 1:
            continue
        ix = sts[0][1]
        first_store = min(p for p, _, _ in sts)
        for inp in k.inputs:
            # The same element offsets (equal index expressions) over storage of the same
            # size: shapes may differ (a view reshapes the input).
            if inp.name in taken or inp.dtype != out.dtype or inp.nbytes != out.nbytes:
                continue
            if loads.get(inp.name) == {ix} and last_load[inp.name] <= first_store:
                pairs.append((out.name, inp.name))
                taken.add(inp.name)
                break
    return tuple(pairs)


# Rows up to this many bytes of float64 are read twice for a variance (mean, then squared
# deviations) instead of with Welford's recurrence: from cache the second read is cheap,
# and the two simple sums vectorise better than Welford's dependent updates.
TWO_PASS_MAX_BYTES = 64 * 1024


def _variance_algorithm(k: Kernel) -> Kernel:
    if k.schedule is not Schedule.ROWS or k.inner_size * 8 > TWO_PASS_MAX_BYTES:
        return k
    passes = []
    for p in k.passes:
        accs = p.accumulates
        simple = all(a.row.family is not Family.ARGSELECT for a in accs)
        if simple and any(a.row.family is Family.WELFORD for a in accs):
            accs = tuple(
                replace(a, algorithm="two_pass") if a.row.family is Family.WELFORD else a
                for a in accs
            )
        passes.append(replace(p, accumulates=accs))
    return replace(k, passes=tuple(passes))


def _choose(k: Kernel) -> Schedule:
    """rows: each thread reduces whole rows, lanes along the reduced dimension.
    columns: the dimension memory walks contiguously is a kept one (a reduction over
    leading dims, channels-last statistics), or each output reduces a small window (a
    pool): lanes are neighbouring outputs.
    split: few long rows: every thread takes a slice of each row.
    columns_split: columns, but too few blocks of them for the threads (BatchNorm
    statistics of 64 channels-last channels: one block): every thread takes a slice of the
    reduced rows and the threads merge their lanes."""
    if not k.inner:
        return Schedule.POINTWISE
    primary = _largest_stream(k)
    if primary is not None and k.outer:
        unit = [v for v in (*k.outer, *k.inner) if abs(primary.coef(v)) == 1]
        vec = k.outer[-1]
        walks = unit and unit[0] == vec and not _moves_opaquely(primary, vec)
        if walks or _window(k, primary, vec):
            blocks = (k.outer_size // vec.extent) * -(-vec.extent // COLUMN_LANES)
            work = k.inner_size * min(vec.extent, COLUMN_LANES)
            # (the work per block first: it does not grow with the batch, so at symbolic
            # sizes a short row decides without the blocks, which do: ResNet-50's global
            # pool compiled again at batch 4 for a decision that changed nothing)
            if work >= SPLIT_MIN_INNER and blocks < SPLIT_MAX_OUTER:
                return Schedule.COLUMNS_SPLIT
            return Schedule.COLUMNS
    if k.inner_size >= SPLIT_MIN_INNER and k.outer_size < SPLIT_MAX_OUTER:
        return Schedule.SPLIT
    # Threads that share lines are slower than threads that meet at two barriers per row,
    # while the rows are long: measured BatchNorm over NCHW writing channels-last,
    # 8x16x64x64 1.48 -> 0.53 ms, 8x128x28x28 3.18 -> 1.41, 1x64x56x56 0.56 -> 0.39;
    # but 8x256x14x14 0.75 -> 0.91 and 8x1024x7x7 0.94 -> 2.71 (rows of 1568 and 392).
    if (
        k.outer
        and k.inner[0].extent >= SPLIT_MIN_SLICES
        and k.inner_size >= SPLIT_SHARED_LINES_MIN_INNER
        and _shares_lines(k)
    ):
        return Schedule.SPLIT
    return Schedule.ROWS


def _window(k: Kernel, primary: Ix, vec: Var) -> bool:
    """A pooling window (few reduced elements per output, in short runs): lanes along the
    output's contiguous dimension beat rows of a handful of elements, even where the lanes
    read with a stride (NCHW max pooling 3x3 / 2, 8x64x112x112: rows 20 ms, lanes 9 ms)."""
    run = max((v.extent for v in k.inner if abs(primary.coef(v)) == 1), default=1)
    step = _step(primary, vec)
    if step is None or (run >= WINDOW_RUN and abs(step) >= run):
        # neighbouring outputs read disjoint contiguous runs (a sum over a short last
        # dimension): rows reduce those; overlapping windows (stride < run) take lanes
        return False
    stores = _store_indices(k)
    if not stores or any(abs(ix.coef(vec)) != 1 for ix in stores):
        return False
    # (the length last: a symbolic one, a softmax's row, then decides nothing where the
    # rest already said no)
    return k.inner_size <= WINDOW_MAX


def _step(ix: Ix, v: Var) -> int | None:
    """How far `ix` moves per step of `v`, clamped edges aside (a padded window's border);
    None where `v` is inside a div or mod."""
    step = 0
    for a, c in ix.terms:
        if a == v:
            step += c
        elif isinstance(a, Clamp):
            inner = _step(a.x, v)
            if inner is None:
                return None
            step += c * inner
        elif not isinstance(a, Var) and v in a.x.variables():
            return None
    return step


def _moves_opaquely(ix: Ix, v: Var) -> bool:
    """Does `v` occur inside a div, mod or clamp of `ix` (its stride there is not its
    coefficient)? Clamps of other variables (a padded window's edges) leave the lanes along
    `v` contiguous."""
    return any(not isinstance(a, Var) and v in a.x.variables() for a, _ in ix.terms)


def _shares_lines(k: Kernel) -> bool:
    """Would threads that take different outer indices write the same cache lines? A store
    inside the reduced loops that steps less than a line per outer index does (BatchNorm
    over NCHW input writing its channels-last result: every line holds all channels)."""
    last = k.outer[-1]
    for p in k.passes:
        for s in p.stores:
            size = next(b.dtype.itemsize for b in k.buffers if b.name == s.buffer)
            step = abs(s.index.coef(last)) * size
            if 0 < step < CACHE_LINE:
                return True
    return False


def _largest_stream(k: Kernel) -> Ix | None:
    """The index of the largest stream the reduced loops walk: the largest input, or an
    output written per reduced element when it is larger still (a bias gradient summed
    over the rows of a gradient it also writes out: the store is the biggest stream)."""
    best: tuple[int, Ix] | None = None
    sizes = {b.name: b.nbytes for b in k.buffers}
    inner = set(k.inner)
    streams = [(buf, ix) for buf, ix in accesses(k) if buf.startswith("in")]
    streams += [
        (s.buffer, s.index) for p in k.passes for s in p.stores if s.index.variables() & inner
    ]
    for buf, ix in streams:
        n = sizes.get(buf, 0)
        if best is None or n > best[0]:
            best = (n, ix)
    return best[1] if best else None


def _groups(vars_: Sequence[Var], ixs: Sequence[Ix], primary: Ix | None) -> list[list[Var]]:
    live = [v for v in vars_ if v.extent > 1]
    if primary is not None:
        pos = {v: i for i, v in enumerate(live)}
        walked = sorted(
            (v for v in live if primary.coef(v)), key=lambda v: (-abs(primary.coef(v)), pos[v])
        )
        rest = [v for v in live if not primary.coef(v)]
        live = rest + walked
    blocked = _blocked(ixs)
    groups: list[list[Var]] = []
    for v in live:
        if (
            groups
            and v not in blocked
            and groups[-1][-1] not in blocked
            and _mergeable(groups[-1], v, ixs)
        ):
            groups[-1].append(v)
        else:
            groups.append([v])
    return groups


def _name_groups(
    groups: list[list[Var]], prefix: str, rename: dict[Var, tuple[Var, int]]
) -> list[Var]:
    out: list[Var] = []
    for i, g in enumerate(groups):
        extent = 1
        for v in g:
            extent *= v.extent
        nv = Var(f"{prefix}{i}", extent)
        out.append(nv)
        # Old variable v contributes coef(v) * v; after merging, the group's innermost
        # variable carries coefficient c and v's coefficient is c * (extent of the vars
        # inside it), so every term maps to new_var * (coef(v) / scale(v)).
        scale = 1
        for v in reversed(g):
            rename[v] = (nv, scale)
            scale *= v.extent
    return out


def rewrite_ix(ix: Ix, rename: dict[Var, tuple[Var, int]]) -> Ix:
    out = Ix.of(ix.const)
    merged: dict[Var, int] = {}
    for atom, c in ix.terms:
        if isinstance(atom, Var):
            nv, scale = rename[atom]
            # coefficient of the new variable: c / scale (exact when mergeable)
            merged[nv] = c // scale if scale > 1 else c
        else:
            env = {v: Ix.var(rename[v][0]) for v in atom.x.variables()}
            out = out + Ix(((atom, c),)).substitute(env)
    for nv, c in merged.items():
        out = out + Ix.var(nv) * c
    return out
