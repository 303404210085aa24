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


def _combine(a: Any, b: Any, op: str, fn: Any) -> Any:
    # (hot: tens of thousands of calls a compile; each test done once)
    if not (isinstance(a, int) and isinstance(b, int)) or bool in (a.__class__, b.__class__):
        return NotImplemented
    sa, sb = isinstance(a, Size), isinstance(b, Size)
    ia, ib = int(a), int(b)
    value = fn(ia, ib)
    if not (sa or sb):
        return value
    # identities keep expressions short (and equal across sizes where they apply alike)
    if not sb and ((ib == 0 and op in ("+", "-")) or (ib == 1 and op in ("*", "//"))):
        return a
    if not sa and ((ia == 0 and op == "+") or (ia == 1 and op == "*")):
        return b
    if op == "*" and not (sa and sb) and (ia == 0 or ib == 0):
        return value  # 0 whatever the other operand is
    x: Any = a  # (a Size where sa: the test above narrowed both to int)
    y: Any = b
    text_a = x.text if sa else int.__repr__(a)
    text_b = y.text if sb else int.__repr__(b)
    if op == "//":
        text = f"opfuse_floordiv({text_a}, {text_b})"
    elif op == "%":
        text = f"opfuse_floormod({text_a}, {text_b})"
    else:
        text = f"({text_a} {op} {text_b})"
    if not sb or (sa and x.leaves == y.leaves):
        leaves = x.leaves
    elif not sa:
        leaves = y.leaves
    else:
        merged = dict(x.leaves)
        merged.update(y.leaves)
        leaves = tuple(sorted(merged.items()))
    return Size(value, text, leaves)


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
