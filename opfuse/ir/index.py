"""Symbolic integer index expressions over loop variables.

A fused kernel reads each tensor at an index computed from its loop variables. Broadcasts,
permutes, slices and expands keep that index affine (a sum of coefficient * variable);
reshapes introduce floor-division and modulo, which `Ix` simplifies away whenever the value
ranges of the loop variables allow it, e.g.

    (i0*W + i1) // W  ->  i0          when 0 <= i1 < W
    W*(i // W) + i % W  ->  i

so that a reshape of contiguous data costs nothing in the generated loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

from .size import Size, gcd


@dataclass(frozen=True)
class Var:
    name: str
    extent: int

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class FloorDiv:
    x: Ix
    d: int

    def __repr__(self) -> str:
        return f"({self.x!r} // {self.d})"


@dataclass(frozen=True)
class Mod:
    x: Ix
    d: int

    def __repr__(self) -> str:
        return f"({self.x!r} % {self.d})"


@dataclass(frozen=True)
class Clamp:
    """min(max(x, 0), hi): the index a gather reads an input at where the element comes
    from elsewhere (a cat's other inputs, a pad's border) -- the input's first or last
    row, which stays in cache, instead of memory outside the tensor."""

    x: Ix
    hi: int

    def __repr__(self) -> str:
        return f"clamp({self.x!r}, 0, {self.hi})"


Atom = Union[Var, FloorDiv, Mod, Clamp]  # noqa: UP007 (a runtime alias: py3.10 has no `type`)


@dataclass(frozen=True)
class Ix:
    """sum(coef * atom) + const, with terms sorted so equal forms compare equal."""

    terms: tuple[tuple[Atom, int], ...] = ()
    const: int = 0

    # -- construction -------------------------------------------------------
    @staticmethod
    def var(v: Var) -> Ix:
        return Ix(((v, 1),), 0) if v.extent > 1 else Ix((), 0)

    @staticmethod
    def of(c: int) -> Ix:
        return Ix((), c if isinstance(c, Size) else int(c))  # a Size keeps its expression

    @staticmethod
    def _norm(coefs: Mapping[Atom, int], const: int) -> Ix:
        coefs = dict(coefs)
        # W*(x // W) + x % W == x, and W*((x // W) % H) + x % W == x % (W*H): fold such
        # pairs, which reshapes of contiguous data produce.
        changed = True
        while changed:
            changed = False
            for atom, c in list(coefs.items()):
                if not isinstance(atom, Mod) or c == 0:
                    continue
                partner = FloorDiv(atom.x, atom.d)
                if coefs.get(partner, 0) == c * atom.d:
                    del coefs[atom], coefs[partner]
                    for a2, c2 in atom.x.terms:
                        coefs[a2] = coefs.get(a2, 0) + c * c2
                    const += c * atom.x.const
                    changed = True
                    break
                for other, c2 in list(coefs.items()):
                    if (
                        isinstance(other, Mod)
                        and c2 == c * atom.d
                        and other.x == Ix(((partner, 1),))
                    ):
                        del coefs[atom], coefs[other]
                        merged = atom.x % (atom.d * other.d)
                        for a3, c3 in merged.terms:
                            coefs[a3] = coefs.get(a3, 0) + c * c3
                        const += c * merged.const
                        changed = True
                        break
                if changed:
                    break
        terms = tuple(
            sorted(((a, c) for a, c in coefs.items() if c != 0), key=lambda t: repr(t[0]))
        )
        return Ix(terms, const)

    def __add__(self, other: Ix | int) -> Ix:
        if isinstance(other, int):
            return Ix(self.terms, self.const + other)
        coefs = dict(self.terms)
        for a, c in other.terms:
            coefs[a] = coefs.get(a, 0) + c
        return Ix._norm(coefs, self.const + other.const)

    __radd__ = __add__

    def __sub__(self, other: Ix | int) -> Ix:
        return self + other * -1

    def __rsub__(self, other: int) -> Ix:
        return self * -1 + other

    def __mul__(self, k: int) -> Ix:
        if k == 0:
            return Ix()
        return Ix(tuple((a, c * k) for a, c in self.terms), self.const * k)

    __rmul__ = __mul__

    def _factor(self, d: int) -> tuple[int, Ix, Ix] | None:
        """self == c*q + r with c dividing d and 0 <= r < c: then self // d == q // (d/c)
        and self % d == c*(q % (d/c)) + r. Finds the split a reshape produces, e.g.
        (3072*i + j) // (512*3072) == i // 512 for 0 <= j < 3072."""
        for _, coef in self.terms:
            c = gcd(d, coef if coef > 0 else -coef)
            if c <= 1 or c == d:
                continue
            q, r = self._split(c)
            lo, hi = r.bounds()
            if lo >= 0 and hi < c:
                return c, q, r
        return None

    def __floordiv__(self, d: int) -> Ix:
        assert d > 0
        if d == 1:
            return self
        f = self._factor(d)
        if f is not None:
            c, q, _ = f
            return q // (d // c)
        q, r = self._nonnegative_split(d)
        lo, hi = r.bounds()
        if lo >= 0 and hi < d:
            return q
        if len(r.terms) == 1 and r.const == 0 and r.terms[0][1] == 1:
            atom = r.terms[0][0]
            if isinstance(atom, FloorDiv):  # (x // a) // d == x // (a*d)
                return q + Ix(((FloorDiv(atom.x, atom.d * d), 1),))
        return q + Ix(((FloorDiv(r, d), 1),))

    def __mod__(self, d: int) -> Ix:
        assert d > 0
        if d == 1:
            return Ix()
        f = self._factor(d)
        if f is not None:
            c, q, rest = f
            return (q % (d // c)) * c + rest
        _, r = self._nonnegative_split(d)
        lo, hi = r.bounds()
        if lo >= 0 and hi < d:
            return r
        if len(r.terms) == 1 and r.const == 0 and r.terms[0][1] == 1:
            atom = r.terms[0][0]
            if isinstance(atom, Mod) and atom.d % d == 0:  # (x % (k*d)) % d == x % d
                return atom.x % d
        return Ix(((Mod(r, d), 1),))

    def clamp(self, hi: int) -> Ix:
        """min(max(self, 0), hi), as itself where its range already lies inside."""
        lo, top = self.bounds()
        if lo >= 0 and top <= hi:
            return self
        if lo >= hi:
            return Ix.of(hi)
        if top <= 0:
            return Ix()
        return Ix(((Clamp(self, hi), 1),))

    def _nonnegative_split(self, d: int) -> tuple[Ix, Ix]:
        """_split with r >= 0 everywhere: C's / and % truncate toward zero, so they agree
        with floor division only on non-negative operands (a flip's 5 - i is one)."""
        q, r = self._split(d)
        lo, _ = r.bounds()
        if lo < 0:
            m = -(lo // d)  # periods that lift r's lowest value to >= 0
            q, r = q + -m, r + m * d
        return q, r

    def _split(self, d: int) -> tuple[Ix, Ix]:
        """self == d*q + r, moving every term whose coefficient d divides into q."""
        qt: dict[Atom, int] = {}
        rt: dict[Atom, int] = {}
        for a, c in self.terms:
            if c % d == 0:
                qt[a] = c // d
            else:
                rt[a] = c
        qc, rc = divmod(self.const, d)
        return Ix._norm(qt, qc), Ix._norm(rt, rc)

    # -- analysis -------------------------------------------------------------
    def bounds(self) -> tuple[int, int]:
        lo = hi = self.const
        for a, c in self.terms:
            alo, ahi = atom_bounds(a)
            if c >= 0:
                lo += c * alo
                hi += c * ahi
            else:
                lo += c * ahi
                hi += c * alo
        return lo, hi

    def coef(self, v: Var) -> int:
        for a, c in self.terms:
            if a == v:
                return c
        return 0

    def is_affine(self) -> bool:
        return all(isinstance(a, Var) for a, _ in self.terms)

    def variables(self) -> set[Var]:
        out: set[Var] = set()
        for a, _ in self.terms:
            if isinstance(a, Var):
                out.add(a)
            else:
                out |= a.x.variables()
        return out

    def substitute(self, env: Mapping[Var, Ix]) -> Ix:
        out = Ix.of(self.const)
        for a, c in self.terms:
            if isinstance(a, Var):
                out = out + env.get(a, Ix.var(a)) * c
            elif isinstance(a, FloorDiv):
                out = out + (a.x.substitute(env) // a.d) * c
            elif isinstance(a, Clamp):
                out = out + a.x.substitute(env).clamp(a.hi) * c
            else:
                out = out + (a.x.substitute(env) % a.d) * c
        return out

    def __repr__(self) -> str:
        parts = [repr(a) if c == 1 else f"{c}*{a!r}" for a, c in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts)


def atom_bounds(a: Atom) -> tuple[int, int]:
    if isinstance(a, Var):
        return 0, a.extent - 1
    lo, hi = a.x.bounds()
    if isinstance(a, FloorDiv):
        return lo // a.d, hi // a.d
    if isinstance(a, Clamp):
        return min(max(lo, 0), a.hi), min(max(hi, 0), a.hi)
    if lo >= 0 and hi < a.d:
        return lo, hi
    return 0, a.d - 1


def address(index: Sequence[Ix], strides: Sequence[int], offset: int = 0) -> Ix:
    """Element offset of a multi-index in a strided tensor."""
    out = Ix.of(offset)
    for i, s in zip(index, strides):
        out = out + i * s
    return out


def linearize(index: Sequence[Ix], shape: Sequence[int]) -> Ix:
    """Row-major flat position of `index` within `shape`."""
    out = Ix()
    for i, n in zip(index, shape):
        out = out * n + i
    return out


def delinearize(flat: Ix, shape: Sequence[int]) -> tuple[Ix, ...]:
    """The multi-index in `shape` whose row-major flat position is `flat`."""
    out: list[Ix] = []
    step = 1
    for n in reversed(shape):
        out.append((flat // step) % n if n > 1 else Ix())
        step *= n
    return tuple(reversed(out))
