"""A pointwise kernel whose vector loop runs a few iterations: unrolled into the loop
around it.

The vector loop walks the variable the first output is contiguous along. Where that
variable is short (an NCHW -> NHWC copy of an RGB image: 3 channels per pixel; boxes of 4
coordinates; pairs), the loop is mostly its own overhead -- a lane mask or a scalar tail,
and a stack chunk per iteration where a load must be gathered -- and runs once per
element of the loop around it. Unrolled, each of its iterations becomes a store of its
own in the body of the loop around it, which becomes the vector loop: the stores write
interleaved groups that gcc vectorises as such, and the loads walk along that loop
(the 224x224 image's NCHW -> NHWC copy, one thread: 57 -> 13 us).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ..ir.index import Ix
from ..ir.scalar import Expr
from ..ir.size import is_size
from .kernel import Kernel, Pass, Schedule, Store, rewrite
from .split import fold

SHORT = 8  # iterations: fewer than one vector of floats (AVX2), a loop mostly of overhead
MAX_STORES = 16  # the unrolled body's stores: more copies of the expressions than it saves


def unroll_short_vector(k: Kernel) -> Kernel:
    """`k` with its vector loop unrolled into the loop around it when that loop is short
    (the note "unrolled" names it), else `k` itself."""
    if k.schedule is not Schedule.POINTWISE or len(k.outer) < 2 or k.checks:
        return k
    if k.pieces or k.cases or len(k.passes) != 1:
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
