"""The symbolic sizes of a graph dynamo hands over, carried into its captured Graph.

A graph with symbolic sizes is captured at the sizes of the call (convert.capture_fx).
Each size, stride and size argument that dynamo knows as an expression of its symbols
(`s0`, `768*s0`) becomes an `ir.size.Size`: the int of this call, which also prints as the
expression when C is rendered, so every size renders the same kernels (ir/size.py says
why that is sound). An expression is rebuilt from the symbols' values with Python
arithmetic on Sizes, and kept only where it gives the value the call has.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch

from ..ir.graph import TensorMeta
from ..ir.size import PREFIX, Size, scoped
from ..ir.size import value as size_value

Binding = dict[str, int]  # symbol name -> its value at this call


def bind(placeholders: Sequence[Any], example_inputs: Sequence[Any]) -> Binding:
    """Each symbol's value at this call, read where a graph input's size is the bare
    symbol (dynamo makes every symbol some input's size or an int input)."""
    out: Binding = {}
    for val, given in zip(placeholders, example_inputs):
        if isinstance(val, torch.SymInt) and isinstance(given, int):
            _learn(out, val, given)
        elif isinstance(val, torch.Tensor) and isinstance(given, torch.Tensor):
            for s, g in zip((*val.shape, *val.stride()), (*given.shape, *given.stride())):
                _learn(out, s, int(g))
    return out


def _learn(out: Binding, s: Any, value: int) -> None:
    expr = _expr(s)
    if isinstance(expr, sympy.Symbol):
        out.setdefault(str(expr), value)


def _expr(symbolic: Any) -> Any:
    """The sympy expression of a SymInt, SymFloat or SymBool where it has size symbols in
    it; else None (a plain value, or a symbolic value dynamo has made a constant)."""
    expr = getattr(getattr(symbolic, "node", None), "expr", None)
    return expr if getattr(expr, "free_symbols", None) else None


def sized(value: Any, symbolic: Any, binding: Binding) -> Any:
    """`value` (a plain int) as a Size when `symbolic` is an expression of the bound
    symbols that evaluates to it; else `value`, which, where `symbolic` is an expression
    of symbols (a float, a bool, a size with no C form), is recorded as fixed
    (`fixing`)."""
    expr = _expr(symbolic)
    if expr is None:
        return value
    if binding and isinstance(value, int) and not isinstance(value, bool):
        try:
            got = _evaluate(expr, binding)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            got = None
        if isinstance(got, Size) and size_value(got) == value:
            return got
    _record(expr, value)
    return value


class Fixed:
    """A value the capture took from an expression of size symbols as a plain number: a
    test of the symbols' values (by C name) that the expression gives it there too."""

    def __init__(self, expr: Any, value: Any) -> None:
        self.expr, self.value = expr, value

    def __repr__(self) -> str:
        return f"{self.expr} = {self.value}"

    def __call__(self, values: Mapping[str, int]) -> bool:
        at = {}
        for sym in self.expr.free_symbols:
            v = values.get(PREFIX + str(sym))
            if v is None:
                return False
            at[sym] = sympy.Integer(v)
        try:
            return bool(type(self.value)(self.expr.xreplace(at)) == self.value)
        except (TypeError, ValueError, ArithmeticError):
            return False


_fixed: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "opfuse_fixed_sizes", default=None
)


def fixing(into: list[Any]) -> contextlib.AbstractContextManager[list[Any]]:
    """Record the values taken from symbolic expressions as plain numbers inside (into
    `into`: a Graph's `fixed`)."""
    return scoped(_fixed, into)


def fix(symbolic: Any, value: Any) -> None:
    """`symbolic` (a SymInt, SymFloat or SymBool, or anything else) taken as the plain
    `value`: recorded where it is an expression of size symbols."""
    expr = _expr(symbolic)
    if expr is not None:
        _record(expr, value)


def _record(expr: Any, value: Any) -> None:
    log = _fixed.get()
    if log is not None:
        log.append(Fixed(expr, value))


def is_symbolic(size: Any) -> bool:
    """Is `size` (an int or a SymInt) an expression of symbols?"""
    return _expr(size) is not None


def has_symbolic_sizes(t: torch.Tensor) -> bool:
    """Is a size or stride of (fake) tensor t an expression of symbols?"""
    return any(is_symbolic(s) for s in (*t.shape, *t.stride()))


def value_of(symbolic: Any, binding: Binding) -> int | None:
    """An int, or a SymInt's expression evaluated with the bound symbols (None: it has
    others, or no form here)."""
    expr = getattr(getattr(symbolic, "node", None), "expr", None)
    if expr is None:
        return int(symbolic)
    try:
        return int(_evaluate(expr, binding))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def sized_meta(meta: TensorMeta, val: Any, binding: Binding) -> TensorMeta:
    """meta with its sizes, strides and offset as Sizes where `val` (the fx node's
    symbolic value) has them symbolic."""
    if not binding or not isinstance(val, torch.Tensor) or val.dim() != meta.ndim:
        return meta
    shape = tuple(sized(v, s, binding) for v, s in zip(meta.shape, val.shape))
    stride = tuple(sized(v, s, binding) for v, s in zip(meta.stride, val.stride()))
    offset = sized(meta.offset, val.storage_offset(), binding)
    return TensorMeta(shape, stride, meta.dtype, meta.device, offset)


_ARITH = {sympy.Add: operator.add, sympy.Mul: operator.mul}


def _evaluate(expr: Any, binding: Binding) -> Any:
    """expr evaluated with each symbol a Size: the result prints as expr in C."""
    if isinstance(expr, sympy.Symbol):
        return Size.symbol(str(expr), binding[str(expr)])
    if isinstance(expr, sympy.Integer):
        return int(expr)
    for kind, fn in _ARITH.items():
        if isinstance(expr, kind):
            args = [_evaluate(a, binding) for a in expr.args]
            acc = args[0]
            for a in args[1:]:
                acc = fn(acc, a)
            return acc
    if isinstance(expr, sympy.Pow) and isinstance(expr.exp, sympy.Integer) and expr.exp > 0:
        base = _evaluate(expr.base, binding)
        acc = base
        for _ in range(int(expr.exp) - 1):
            acc = acc * base
        return acc
    name = type(expr).__name__
    if name in ("FloorDiv", "CleanDiv") and len(expr.args) == 2:
        a, b = (_evaluate(x, binding) for x in expr.args)
        return a // b
    if name in ("Mod", "PythonMod") and len(expr.args) == 2:
        a, b = (_evaluate(x, binding) for x in expr.args)
        return a % b
    raise ValueError(f"no C form for {name}")
