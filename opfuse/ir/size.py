"""Sizes that know which symbolic size they came from.

A graph dynamo hands over with symbolic sizes (`s0`) is still compiled per size, but its
kernels need not be: a `Size` is an int (its value at the size being compiled, which every
decision reads as any int) that also carries a C expression of the graph's size symbols.
While C is rendered (`symbolic_text()`), printing a Size prints that expression, and the
kernel takes the symbols it printed as arguments. Every size of the graph then renders the
same source wherever its decisions came out the same, and the source is built once (the
build cache is keyed by the source).

Why this is sound whatever the decisions were: each size renders its own source, in which
every printed expression evaluates, with the symbol values the kernel is passed (those of
the Sizes it printed, never two for one symbol), to the value Python used. Two sizes share
a library only when their sources are equal text, so the library computes, for each of
them, what its own source does. Arithmetic on Sizes keeps the expression (+, -, *, //, %,
negation); anything else (min/max return an operand; divmod, abs, bit operations) yields a
plain int, printed as its value: correct, merely specific to that size.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import operator
from collections.abc import Iterator
from typing import Any

# symbol -> value of every Size printed while rendering, or None: print values
_printing: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar(
    "opfuse_size_printing", default=None
)

PREFIX = "opfuse_"  # C names of the symbols: no collision with the kernels' own names


def _operator(op: str, fn: Any) -> tuple[Any, Any]:
    """A binary operator of Size and its reflected form, both keeping the expression."""

    def left(self: Any, other: Any) -> Any:
        return _combine(self, other, op, fn)

    def right(self: Any, other: Any) -> Any:
        return _combine(other, self, op, fn)

    return left, right


class Size(int):
    """An int with a C expression over size symbols (`leaves`: the symbols' values at the
    size being compiled)."""

    text: str
    leaves: tuple[tuple[str, int], ...]

    def __new__(cls, value: int, text: str, leaves: tuple[tuple[str, int], ...]) -> Size:
        obj = super().__new__(cls, value)
        obj.text = text
        obj.leaves = leaves
        return obj

    @staticmethod
    def symbol(name: str, value: int) -> Size:
        c = PREFIX + name
        return Size(value, c, ((c, int(value)),))

    def __reduce__(self) -> Any:  # copies and pickles are plain ints
        return (int, (int(self),))

    # -- printing ------------------------------------------------------------------------
    def _shown(self) -> str:
        seen = _printing.get()
        if seen is None or any(seen.get(n, v) != v for n, v in self.leaves):
            # A Size of another size where one symbol already printed with a different
            # value (an interned expression of an earlier compile, equal in value): the
            # value is what is meant.
            return int.__repr__(self)
        for name, value in self.leaves:
            seen.setdefault(name, value)
        return self.text

    def __repr__(self) -> str:
        return self._shown()

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return int.__format__(int(self), spec) if spec else self._shown()

    # -- arithmetic keeps the expression -------------------------------------------------
    __add__, __radd__ = _operator("+", int.__add__)
    __sub__, __rsub__ = _operator("-", int.__sub__)
    __mul__, __rmul__ = _operator("*", int.__mul__)
    __floordiv__, __rfloordiv__ = _operator("//", int.__floordiv__)
    __mod__, __rmod__ = _operator("%", int.__mod__)

    def __neg__(self) -> Any:
        return Size(-int(self), f"(-{self.text})", self.leaves)

    def __pos__(self) -> Any:
        return self


def value_at(x: int, values: dict[str, int]) -> int:
    """x's value where the size symbols take `values` (by C name; a symbol not named keeps
    its own); a plain int is itself."""
    if not isinstance(x, Size):
        return int(x)
    env = {n: values.get(n, v) for n, v in x.leaves}
    return int(eval(_code(x.text), _EVAL_GLOBALS, env))  # our own expression text


@functools.lru_cache(maxsize=4096)
def _code(text: str) -> Any:
    return compile(text, "<size>", "eval")


_EVAL_GLOBALS: dict[str, Any] = {
    "__builtins__": {},
    "opfuse_floordiv": operator.floordiv,
    "opfuse_floormod": operator.mod,
}


def gcd(a: int, b: int) -> int:
    """math.gcd that returns an operand (a Size keeps its expression) when it is the
    result."""
    g = math.gcd(a, b)
    for x in (a, b):
        if x == g and isinstance(x, Size):
            return x
    return g


def is_size(x: object) -> bool:
    """Is x a Size (an int that prints as an expression of size symbols)?"""
    return isinstance(x, Size)


def _text(x: int) -> str:
    return x.text if isinstance(x, Size) else int.__repr__(x)


def _combine(a: Any, b: Any, op: str, fn: Any) -> Any:
    if (
        not (isinstance(a, int) and isinstance(b, int))
        or isinstance(a, bool)
        or isinstance(b, bool)
    ):
        return NotImplemented
    value = fn(int(a), int(b))
    if not isinstance(a, Size) and not isinstance(b, Size):
        return value
    # identities keep expressions short (and equal across sizes where they apply alike)
    if (op in ("+", "-") and not isinstance(b, Size) and int(b) == 0) or (
        op in ("*", "//") and not isinstance(b, Size) and int(b) == 1
    ):
        return a
    if op == "+" and not isinstance(a, Size) and int(a) == 0:
        return b
    if op == "*" and not isinstance(a, Size) and int(a) == 1:
        return b
    if op == "*" and 0 in (int(a), int(b)) and not (isinstance(a, Size) and isinstance(b, Size)):
        return value  # 0 whatever the other operand is
    if op == "//":
        text = f"opfuse_floordiv({_text(a)}, {_text(b)})"
    elif op == "%":
        text = f"opfuse_floormod({_text(a)}, {_text(b)})"
    else:
        text = f"({_text(a)} {op} {_text(b)})"
    leaves = dict(a.leaves if isinstance(a, Size) else ())
    leaves.update(b.leaves if isinstance(b, Size) else ())
    return Size(value, text, tuple(sorted(leaves.items())))


@contextlib.contextmanager
def symbolic_text() -> Iterator[dict[str, int]]:
    """Print Sizes as their expressions inside; yields the symbols printed, with values."""
    seen: dict[str, int] = {}
    token = _printing.set(seen)
    try:
        yield seen
    finally:
        _printing.reset(token)


# C helpers the expressions call: floor division and modulo as Python defines them (C's
# truncate toward zero).
C_HELPERS = r"""
static inline int64_t opfuse_floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline int64_t opfuse_floormod(int64_t a, int64_t b) {
  int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
"""
