"""Outer loops cut where position tests on them change answer (loop unswitching).

A cat, pad or stack along an outer dimension (an NCHW channel cat, the q/k/v gradients of
an attention layer stacked into one [.., 3, ..] tensor) picks its input with a test on
that dimension's position, and reads every input at every element: the test is not
decided until the element is. The test's answer is the same for the whole loop nest
below the dimension's variable, so the kernel runs as cases, one per range of that
variable between the tests' boundaries: each case a loop nest of its own with the tests
decided, the dead branches and their loads gone (lower/split.py does the same for a
pointwise kernel's innermost loop).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ..ir.index import Ix, Var
from ..ir.scalar import Expr, walk
from .kernel import Kernel, Schedule, rewrite
from .split import cuts_of, fold

MAX_CASES = 8  # more cases than this and the kernel's code grows more than it saves


def unswitch(k: Kernel) -> Kernel:
    """`k` with the cases it runs as (`k.cases`, each a kernel over one range of an outer
    variable; the note "cases" names the cut), or `k` itself to run it whole."""
    if k.checks:
        return k
    # The innermost outer variable of these schedules is the vector loop (split.py) or the
    # block of column lanes: cutting it would cut the vectors.
    vector = k.schedule is Schedule.POINTWISE or k.schedule.columns
    movable = k.outer[:-1] if vector else k.outer
    roots = [e for p in k.passes for e in p.values]
    before = _loads(roots)
    for v in movable:
        cuts = sorted(c for c in cuts_of(roots, v) if 0 < c < v.extent)
        if not cuts or len(cuts) + 1 > MAX_CASES:
            continue
        bounds = list(zip([0, *cuts], [*cuts, v.extent]))
        cases = tuple(case(k, v, lo, hi) for lo, hi in bounds)
        # Worth it only where a case reads less than the whole kernel does.
        if any(_loads([e for p in c.passes for e in p.values]) < before for c in cases):
            sizes = " + ".join(str(hi - lo) for lo, hi in bounds)
            return replace(k, cases=cases, notes={**k.notes, "cases": f"{v.name} = {sizes}"})
    return k


def _loads(roots: list[Expr]) -> int:
    return len({e.value for e in walk(roots) if e.op == "load"})


def case(k: Kernel, v: Var, lo: int, hi: int) -> Kernel:
    """k over iterations [lo, hi) of its outer variable v (as v from 0, tests decided)."""
    var = Var(v.name, hi - lo)
    env = {v: Ix.var(var) + lo}
    memo: dict[Expr, Expr] = {}
    case = rewrite(
        k, functools.partial(fold, env=env, memo=memo), functools.partial(Ix.substitute, env=env)
    )
    return replace(case, outer=tuple(var if u == v else u for u in k.outer))
