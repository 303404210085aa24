"""Splitting loop variables that indices only take apart with // and %.

A loop over a flattened view of a permuted tensor (the [tokens, 3 * heads * head_dim]
gradient of a fused qkv projection, read from three [batch, heads, tokens, head_dim]
gradients) indexes its inputs with x // 64, x % 64, (x // 64) % 12 and x // 768: every
lane computes them and the loads gather element by element. Written as x = 64 * h + l,
those become l and h % 12, h // 12 -- affine loads that vectorise -- and a second split
of h removes the rest. The schedule then merges back whatever every access walks as one.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ..ir.index import FloorDiv, Ix, Mod, Var
from ..ir.size import gcd
from .kernel import Kernel, map_indices

MAX_SPLITS = 8  # nested views rarely take a variable apart more than twice
# A variable an output walks with stride 1 is the vector loop's candidate: split it only
# into parts a vector fills (16 floats), or a pixel shuffle's w -> (w // 2, w % 2) would
# leave a vector loop of 2 where one of W*2 gathered before.
MIN_UNIT_SPLIT = 16


def refine(k: Kernel, accesses: list[Ix], stores: list[Ix]) -> Kernel:
    """`k` with each variable that an index divides at a point its extent is a multiple of
    split there (outer part first). `accesses` are k's index expressions, `stores` those
    of its stores."""
    for _ in range(MAX_SPLITS):
        unit = {v for ix in stores for v in ix.variables() if abs(ix.coef(v)) == 1}
        point = _split_point(accesses, (*k.outer, *k.inner), unit)
        if point is None:
            break
        v, m = point
        hi, lo = Var(f"{v.name}h{m}", v.extent // m), Var(f"{v.name}l{m}", m)
        env = {v: Ix.var(hi) * m + Ix.var(lo)}
        k = map_indices(k, functools.partial(Ix.substitute, env=env))
        accesses = [ix.substitute(env) for ix in accesses]
        stores = [ix.substitute(env) for ix in stores]
        k = replace(k, outer=_replaced(k.outer, v, hi, lo), inner=_replaced(k.inner, v, hi, lo))
    return k


def _replaced(vars_: tuple[Var, ...], v: Var, hi: Var, lo: Var) -> tuple[Var, ...]:
    return tuple(x for u in vars_ for x in ((hi, lo) if u == v else (u,)))


def _split_point(ixs: list[Ix], vars_: tuple[Var, ...], unit: set[Var]) -> tuple[Var, int] | None:
    """(v, m): an index takes `c*v + r` apart at a multiple of c*m, with r inside [0, c)
    (digits below v's) and m a proper divisor of v's extent (at least MIN_UNIT_SPLIT if
    an output walks v with stride 1)."""
    loops = set(vars_)
    stack = list(ixs)
    while stack:
        ix = stack.pop()
        for atom, _ in ix.terms:
            if not isinstance(atom, (FloorDiv, Mod)):
                if not isinstance(atom, Var):
                    stack.append(atom.x)
                continue
            stack.append(atom.x)
            for term, c in atom.x.terms:
                if not isinstance(term, Var) or term not in loops or c <= 0:
                    continue
                lo, top = (atom.x - Ix.var(term) * c).bounds()
                if lo < 0 or top >= c:
                    continue
                m = atom.d // gcd(atom.d, c)
                short = term in unit and m < MIN_UNIT_SPLIT
                if 1 < m < term.extent and term.extent % m == 0 and not short:
                    return term, m
    return None
