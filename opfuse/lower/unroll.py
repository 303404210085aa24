"""Loops of a few iterations written out: a pointwise kernel's short vector loop unrolled
into the loop around it, and a rows kernel's short rows reduced as expressions.

The vector loop walks the variable the first output is contiguous along. Where that
variable is short (an NCHW -> NHWC copy of an RGB image: 3 channels per pixel; boxes of 4
coordinates; pairs), the loop is mostly its own overhead -- a lane mask or a scalar tail,
and a stack chunk per iteration where a load must be gathered -- and runs once per
element of the loop around it. Unrolled, each of its iterations becomes a store of its
own in the body of the loop around it, which becomes the vector loop: the stores write
interleaved groups that gcc vectorises as such, and the loads walk along that loop
(the 224x224 image's NCHW -> NHWC copy, one thread: 57 -> 13 us). A rows kernel over rows
of a few elements (a softmax over 3 classes) ran such loops once per row and pass; written
out, it is a pointwise kernel over its rows.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import replace

import torch

from ..ir.combine import Family, Identity
from ..ir.index import Ix, Var
from ..ir.scalar import Expr, call, cast, const, substitute, walk, where
from ..ir.size import is_size
from .kernel import Accumulate, Kernel, Pass, Schedule, Store, rewrite
from .split import fold

# Iterations: a loop of fewer is mostly its overhead, and gcc 12 vectorises the unrolled
# body's interleaved loads and stores in groups of 2, 3 and 4. Groups of 5-7 it leaves
# scalar: 240000 x s, 2 threads, sigmoid([N, 1] + [1, s]) at s = 5-7 1.3-3.5 -> 2.8-5.4 ms
# unrolled, a LayerNorm over rows of 6-7 1.7-2.0 -> 1.9-2.6 ms written out.
SHORT = 5
MAX_STORES = 16  # the unrolled body's stores: more copies of the expressions than it saves


def unroll_short_vector(k: Kernel) -> Kernel:
    """`k` with its vector loop unrolled into the loop around it when that loop is short
    (the note "unrolled" names it), else `k` itself."""
    if k.schedule is not Schedule.POINTWISE or len(k.outer) < 2 or k.checks:
        return k
    if len(k.passes) != 1:
        return k
    p = k.passes[0]
    vec = k.outer[-1]
    if is_size(vec.extent) or vec.extent >= SHORT or p.accumulates or p.after:
        return k
    if len(p.stores) * vec.extent > MAX_STORES or any(s.guard is not None for s in p.stores):
        return k
    stores: list[Store] = []
    for c in range(vec.extent):
        env = {vec: Ix.of(c)}
        memo: dict[Expr, Expr] = {}
        expr = functools.partial(fold, env=env, memo=memo)
        copy = rewrite(k, expr, functools.partial(Ix.substitute, env=env))
        stores.extend(copy.passes[0].stores)
    row = k.outer[-2]
    note = f"{vec.name} ({vec.extent}) unrolled into {row.name}"
    return replace(
        k,
        outer=k.outer[:-1],
        passes=(Pass(stores=tuple(stores)),),
        notes={**k.notes, "unrolled": note},
    )


# -- reductions over a few elements per row ---------------------------------------------


def write_out_short_rows(k: Kernel) -> Kernel:
    """A rows or columns kernel whose rows hold fewer than SHORT elements (a softmax over
    3 classes, the norm of xyz coordinates, a LayerNorm over 4 features, a 2x2 pool) as a
    pointwise kernel: each reduction written out as an expression of the row's elements,
    each per-element store once per element. Its vector loop then runs over rows where the
    rows schedule ran a few-lane reduction loop per row and pass (softmax over [300000, 3]:
    three loops of 3 per row) and the columns schedule kept lane arrays of partial results
    (2 threads: the norm over [300000, 3] 153-190 -> 55-58 us, a softmax over the 3
    channels of 8x3x128x128 157-172 -> 122-140 us; 2x2 pools over 8x64x112x112 within the
    noise either way). `k` itself where a row is longer, a size is symbolic, or the kernel
    checks or guards."""
    if k.schedule not in (Schedule.ROWS, Schedule.COLUMNS) or not k.inner or k.checks:
        return k
    if any(is_size(v.extent) for v in k.inner) or k.inner_size >= SHORT:
        return k
    if any(s.guard is not None for p in k.passes for s in (*p.stores, *p.after)):
        return k
    shape = [range(v.extent) for v in k.inner]
    points = [{v: Ix.of(c) for v, c in zip(k.inner, cs)} for cs in itertools.product(*shape)]
    if sum(len(p.stores) for p in k.passes) * len(points) > MAX_STORES:
        return k
    results: dict[tuple[str, str], Expr] = {}
    # What the kernel stored so far, by (buffer, index): a later pass that reads an output
    # back (a softmax's exponentials, divided in the last pass) reads the value instead,
    # since a pointwise body computes every value before it stores any.
    stored: dict[tuple[str, Ix], Expr] = {}
    dtypes = {b.name: b.dtype for b in k.buffers}

    def at(e: Expr, point: dict[Var, Ix]) -> Expr:
        return _read_back(fold(e, point, {}), results, stored)

    for p in k.passes:
        for a in p.accumulates:
            values = [at(a.value, pt) for pt in points]
            spots = [a.position.substitute(pt) for pt in points] if a.position is not None else []
            if any(spot.terms for spot in spots):
                return k  # a position that is not a number once the row is written out
            results.update(_combined(a, values, spots))
        # a pass reads what the passes before it stored, its own stores not yet (a row's
        # body loads before it stores: a max's mask compares the value the pass replaces)
        now = {
            (st.buffer, st.index.substitute(pt)): cast(at(st.value, pt), dtypes[st.buffer])
            for pt in points
            for st in p.stores
        }
        stored.update(now)
        after = {(st.buffer, st.index): cast(at(st.value, {}), dtypes[st.buffer]) for st in p.after}
        stored.update(after)
    stores = tuple(Store(buf, ix, value) for (buf, ix), value in stored.items())
    outs = {b.name for b in k.outputs}
    if any(e.op == "load" and e.value[0] in outs for e in walk([s.value for s in stores])):
        return k  # an output read back elsewhere than where this row stored it
    note = f"rows of {k.inner_size} written out"
    return replace(
        k,
        inner=(),
        passes=(Pass(stores=stores),),
        schedule=Schedule.POINTWISE,
        reduction_size=1,
        notes={**k.notes, "rows": note},
    )


def _read_back(
    e: Expr, results: dict[tuple[str, str], Expr], stored: dict[tuple[str, Ix], Expr]
) -> Expr:
    """`e` with its reduction results ("acc" leaves) replaced by their written-out values,
    and its loads of what the kernel stored by the values stored."""
    subs = {
        x: cast(results[x.value] if x.op == "acc" else stored[x.value], x.dtype)
        for x in walk([e])
        if x.op == "acc" or (x.op == "load" and x.value in stored)
    }
    return substitute(e, subs)


def _combined(a: Accumulate, values: list[Expr], spots: list[Ix]) -> dict[tuple[str, str], Expr]:
    """Accumulator `a`'s results ((name, part) -> value) over `values`, its row's elements
    in the loops' order (`spots`: their positions in the row, for an argmax)."""
    row = a.row
    if row.family is Family.WELFORD:
        # two passes over the row, as the rows schedule takes for rows held in cache
        vs = [cast(v, a.acc_dtype) for v in values]
        mean = functools.reduce(operator.add, vs) / const(len(vs), a.acc_dtype)
        m2 = functools.reduce(operator.add, [(v - mean) * (v - mean) for v in vs])
        return {(a.name, "mean"): mean, (a.name, "m2"): m2}
    if row.family is Family.ARGSELECT:
        # in the order of the positions (the loops may walk the row in another): ties go
        # to the first
        ordered = sorted(zip(spots, values), key=lambda sv: sv[0].const)
        best, index = ordered[0][1], const(ordered[0][0].const, torch.int64)
        for spot, v in ordered[1:]:
            beyond = v > best if row.op == "max" else v < best
            # NaN wins, then the first: a later NaN does not replace an earlier one
            take = beyond | (call("isnan", v) & call("eq", best, best))
            best, index = where(take, v, best), where(take, const(spot.const, torch.int64), index)
        return {(a.name, "value"): best, (a.name, "index"): index}
    if row.family is Family.SELECT:
        return {(a.name, "value"): functools.reduce(functools.partial(call, row.prim), values)}
    total = const(0 if row.identity is Identity.ZERO else 1, a.acc_dtype)
    for v in values:
        total = call(row.prim, total, cast(v, a.acc_dtype))
    return {(a.name, "value"): total}
