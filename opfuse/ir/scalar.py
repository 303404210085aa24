"""Scalar expressions: what one element of a fused kernel computes.

ATen pointwise ops are written (in `ops.py`) as formulas over a small set of scalar
primitives. Each primitive is one row of `PRIMS`: its arity, how its result type follows
from its operands, and its formula for every backend. Renderers look formulas up here and
decide nothing.

`Expr` is immutable and compares structurally, so identical subexpressions are shared
(common-subexpression elimination falls out of hashing). Python operators build
expressions: `x * 0.5 + 1` is an `Expr`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .size import Size
from .size import value as size_value

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic happens in: half types compute in float32, as torch does."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


@dataclass(frozen=True)
class Prim:
    """One scalar primitive. `result` says how its dtype follows from the operands:
    'same' (operands' common dtype), 'bool', or 'cast' (the Expr carries it)."""

    arity: int
    result: str
    c: str  # C formula; {0},{1},.. are operands, {f} is 'f' for float32 math, {T} the C type
    c_int: str | None = None  # C formula for integer/bool operands when it differs
    triton: str = ""
    triton_int: str | None = None
    float_only: bool = False  # integer operands are cast to float first (exp, sin, ...)
    # How a bound of |result| follows from bounds of its operands' (lower/bounds.py): "sum"
    # (|a| + |b|), "prod", "fma" (|a| |b| + |c|), "max" (the larger), "same" (the
    # operand's), "unit" (1, for a finite operand); "" where none is known (exp, division)
    bound: str = ""


def _u(c: str, triton: str, **kw: Any) -> Prim:
    return Prim(1, "same", c, triton=triton, float_only=True, **kw)


# fmt: off
PRIMS: dict[str, Prim] = {
    # arithmetic
    "add": Prim(2, "same", "({0} + {1})", triton="({0} + {1})", bound="sum"),
    "sub": Prim(2, "same", "({0} - {1})", triton="({0} - {1})", bound="sum"),
    "mul": Prim(2, "same", "({0} * {1})", triton="({0} * {1})", bound="prod"),
    "div": Prim(2, "same", "({0} / {1})", "op_div_trunc_{T}({0}, {1})",
                triton="({0} / {1})", triton_int="tl.extra.div_rn({0}, {1})"),
    "truncdiv": Prim(2, "same", "trunc{f}({0} / {1})", "op_div_trunc_{T}({0}, {1})",
                     triton="libdevice.trunc({0} / {1})", triton_int="({0} // {1})"),
    "floordiv": Prim(2, "same", "op_div_floor_{T}({0}, {1})", "op_div_floor_{T}({0}, {1})",
                     triton="op_div_floor({0}, {1})", triton_int="op_div_floor_int({0}, {1})"),
    "fmod": Prim(2, "same", "fmod{f}({0}, {1})", "op_fmod_{T}({0}, {1})",
                 triton="libdevice.fmod({0}, {1})", triton_int="op_fmod_int({0}, {1})"),
    "remainder": Prim(2, "same", "op_remainder_{T}({0}, {1})", "op_remainder_{T}({0}, {1})",
                      triton="op_remainder({0}, {1})", triton_int="op_remainder_int({0}, {1})"),
    "pow": Prim(2, "same", "pow{f}({0}, {1})", "op_pow_{T}({0}, {1})",
                triton="libdevice.pow({0}, {1})", triton_int="op_pow_int({0}, {1})"),
    "max": Prim(2, "same", "op_max_{T}({0}, {1})", "(({0} < {1}) ? {1} : {0})",
                triton="op_max({0}, {1})", triton_int="tl.maximum({0}, {1})", bound="max"),
    "min": Prim(2, "same", "op_min_{T}({0}, {1})", "(({1} < {0}) ? {1} : {0})",
                triton="op_min({0}, {1})", triton_int="tl.minimum({0}, {1})", bound="max"),
    "fmax": Prim(2, "same", "fmax{f}({0}, {1})", "(({0} < {1}) ? {1} : {0})",
                 triton="libdevice.fmax({0}, {1})", triton_int="tl.maximum({0}, {1})", bound="max"),
    "fmin": Prim(2, "same", "fmin{f}({0}, {1})", "(({1} < {0}) ? {1} : {0})",
                 triton="libdevice.fmin({0}, {1})", triton_int="tl.minimum({0}, {1})", bound="max"),
    "atan2": Prim(2, "same", "atan2{f}({0}, {1})", triton="libdevice.atan2({0}, {1})",
                  float_only=True),
    "copysign": Prim(2, "same", "copysign{f}({0}, {1})", triton="libdevice.copysign({0}, {1})",
                     float_only=True),
    "hypot": Prim(2, "same", "hypot{f}({0}, {1})", triton="libdevice.hypot({0}, {1})",
                  float_only=True),
    # {0} * {1} + {2} rounded once, as torch's vector kernels compute add/sub with an
    # alpha and lerp
    "fma": Prim(3, "same", "fma{f}({0}, {1}, {2})", "({0} * {1} + {2})",
                triton="libdevice.fma({0}, {1}, {2})", triton_int="({0} * {1} + {2})",
                bound="fma"),
    "neg": Prim(1, "same", "(-{0})", "op_neg_{T}({0})", triton="(-{0})", bound="same"),
    "abs": Prim(1, "same", "fabs{f}({0})", "(({0} < 0) ? op_neg_{T}({0}) : {0})",
                triton="tl.abs({0})", bound="same"),
    "sign": Prim(1, "same", "(({T})(({0} > 0) - ({0} < 0)))", "(({T})(({0} > 0) - ({0} < 0)))",
                 triton="(({0} > 0).to({0}.dtype) - ({0} < 0).to({0}.dtype))"),
    "exp": _u("op_exp_{T}({0})", "libdevice.exp({0})"),
    "exp2": _u("exp2{f}({0})", "libdevice.exp2({0})"),
    "expm1": _u("expm1{f}({0})", "libdevice.expm1({0})"),
    "log": _u("log{f}({0})", "libdevice.log({0})"),
    "log2": _u("log2{f}({0})", "libdevice.log2({0})"),
    "log10": _u("log10{f}({0})", "libdevice.log10({0})"),
    "log1p": _u("log1p{f}({0})", "libdevice.log1p({0})"),
    "sqrt": _u("sqrt{f}({0})", "libdevice.sqrt({0})"),
    "rsqrt": _u("(1 / sqrt{f}({0}))", "(1.0 / libdevice.sqrt({0}))"),
    "reciprocal": _u("(1 / {0})", "(1.0 / {0})"),
    "sin": _u("sin{f}({0})", "libdevice.sin({0})", bound="unit"),
    "cos": _u("cos{f}({0})", "libdevice.cos({0})", bound="unit"),
    "tan": _u("tan{f}({0})", "libdevice.tan({0})"),
    "asin": _u("asin{f}({0})", "libdevice.asin({0})"),
    "acos": _u("acos{f}({0})", "libdevice.acos({0})"),
    "atan": _u("atan{f}({0})", "libdevice.atan({0})"),
    "sinh": _u("sinh{f}({0})", "libdevice.sinh({0})"),
    "cosh": _u("cosh{f}({0})", "libdevice.cosh({0})"),
    "tanh": _u("tanh{f}({0})", "libdevice.tanh({0})", bound="unit"),
    "asinh": _u("asinh{f}({0})", "libdevice.asinh({0})"),
    "acosh": _u("acosh{f}({0})", "libdevice.acosh({0})"),
    "atanh": _u("atanh{f}({0})", "libdevice.atanh({0})"),
    "sigmoid": _u("(1 / (1 + op_exp_{T}(-{0})))", "(1.0 / (1.0 + libdevice.exp(-{0})))", bound="unit"),
    "erf": _u("erf{f}({0})", "libdevice.erf({0})", bound="unit"),
    "erfc": _u("erfc{f}({0})", "libdevice.erfc({0})"),
    "lgamma": _u("lgamma{f}({0})", "libdevice.lgamma({0})"),
    "floor": Prim(1, "same", "floor{f}({0})", "{0}", triton="libdevice.floor({0})",
                  triton_int="{0}"),
    "ceil": Prim(1, "same", "ceil{f}({0})", "{0}", triton="libdevice.ceil({0})",
                 triton_int="{0}"),
    "trunc": Prim(1, "same", "trunc{f}({0})", "{0}", triton="libdevice.trunc({0})",
                  triton_int="{0}"),
    "round": Prim(1, "same", "nearbyint{f}({0})", "{0}", triton="libdevice.nearbyint({0})",
                  triton_int="{0}"),
    # comparisons and predicates
    "eq": Prim(2, "bool", "({0} == {1})", triton="({0} == {1})"),
    "ne": Prim(2, "bool", "({0} != {1})", triton="({0} != {1})"),
    "lt": Prim(2, "bool", "({0} < {1})", triton="({0} < {1})"),
    "le": Prim(2, "bool", "({0} <= {1})", triton="({0} <= {1})"),
    "gt": Prim(2, "bool", "({0} > {1})", triton="({0} > {1})"),
    "ge": Prim(2, "bool", "({0} >= {1})", triton="({0} >= {1})"),
    "isnan": Prim(1, "bool", "({0} != {0})", "0", triton="({0} != {0})", triton_int="False"),
    "isinf": Prim(1, "bool", "(fabs{f}({0}) == INFINITY)", "0",
                  triton="(tl.abs({0}) == float('inf'))", triton_int="False"),
    "signbit": Prim(1, "bool", "(signbit({0}) != 0)", "({0} < 0)",
                    triton="(libdevice.signbit({0}) != 0)", triton_int="({0} < 0)"),
    # logic and bits (operands already bool or integer)
    "and": Prim(2, "same", "({0} & {1})", triton="({0} & {1})"),
    "or": Prim(2, "same", "({0} | {1})", triton="({0} | {1})"),
    "xor": Prim(2, "same", "({0} ^ {1})", triton="({0} ^ {1})"),
    "not": Prim(1, "same", "(!{0})", "op_not_{T}({0})", triton="(~{0})"),
    "shl": Prim(2, "same", "op_shl_{T}({0}, {1})", "op_shl_{T}({0}, {1})", triton="op_shl({0}, {1})"),
    "shr": Prim(2, "same", "op_shr_{T}({0}, {1})", "op_shr_{T}({0}, {1})", triton="op_shr({0}, {1})"),
    # counter-based random bits: SplitMix64's finaliser of seed + (counter + 1) * golden
    "mix64": Prim(2, "same", "op_mix64({0}, {1})", "op_mix64({0}, {1})",
                  triton="op_mix64({0}, {1})"),
    # selection and conversion
    "where": Prim(3, "where", "({0} ? {1} : {2})", triton="tl.where({0}, {1}, {2})", bound="max"),
    "cast": Prim(1, "cast", "op_cast", triton="op_cast"),  # renderers own conversions
}
# fmt: on

# Integer division and modulo by zero raise in torch; kernels record it in an error flag.
RAISES_ON_ZERO = frozenset({"div", "truncdiv", "floordiv", "fmod", "remainder"})


class Expr:
    """A scalar expression. `value` holds a constant's number, a load's (buffer, index),
    a reduction result's name, or a loop variable's name.

    Expressions are hash-consed: building the same expression twice returns the same
    object, so equality is identity and hashing is O(1) however deep the DAG is.
    """

    __slots__ = ("__weakref__", "args", "dtype", "op", "value")
    op: str
    args: tuple[Expr, ...]
    dtype: torch.dtype
    value: Any

    def __new__(
        cls, op: str, args: tuple[Expr, ...], dtype: torch.dtype, value: Any = None
    ) -> Expr:
        sizes = _sizes.get()
        held = _sized_key(value) if sizes else _value_key(value)
        key = (op, tuple(id(a) for a in args), dtype, held, sizes)
        hit = _INTERNED.get(key)
        if hit is not None:
            return hit
        e = super().__new__(cls)
        object.__setattr__(e, "op", op)
        object.__setattr__(e, "args", args)
        object.__setattr__(e, "dtype", dtype)
        object.__setattr__(e, "value", value)
        _INTERNED[key] = e
        return e

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Expr is immutable")

    def __repr__(self) -> str:
        if self.op == "const":
            return repr(self.value)
        if self.op in ("load", "var", "acc"):
            return f"{self.op}({self.value})"
        return f"{self.op}({', '.join(map(repr, self.args))})"

    # Python operators build expressions; == and != stay structural equality (use eq/ne).
    def __add__(self, o: Any) -> Expr:
        return binary("add", self, o)

    def __radd__(self, o: Any) -> Expr:
        return binary("add", o, self)

    def __sub__(self, o: Any) -> Expr:
        return binary("sub", self, o)

    def __rsub__(self, o: Any) -> Expr:
        return binary("sub", o, self)

    def __mul__(self, o: Any) -> Expr:
        return binary("mul", self, o)

    def __rmul__(self, o: Any) -> Expr:
        return binary("mul", o, self)

    def __truediv__(self, o: Any) -> Expr:
        return binary("div", self, o)

    def __rtruediv__(self, o: Any) -> Expr:
        return binary("div", o, self)

    def __neg__(self) -> Expr:
        return unary("neg", self)

    def __lt__(self, o: Any) -> Expr:
        return binary("lt", self, o)

    def __le__(self, o: Any) -> Expr:
        return binary("le", self, o)

    def __gt__(self, o: Any) -> Expr:
        return binary("gt", self, o)

    def __ge__(self, o: Any) -> Expr:
        return binary("ge", self, o)

    def __and__(self, o: Any) -> Expr:
        return binary("and", self, o)

    def __or__(self, o: Any) -> Expr:
        return binary("or", self, o)

    def __xor__(self, o: Any) -> Expr:
        return binary("xor", self, o)

    def __invert__(self) -> Expr:
        return unary("not", self)

    def __eq__(self, o: object) -> bool:
        return self is o

    def __hash__(self) -> int:
        return id(self)

    def __bool__(self) -> bool:
        raise TypeError("a scalar Expr has no truth value; use where()")

    @property
    def is_const(self) -> bool:
        return self.op == "const"


def _value_key(value: Any) -> Any:
    # -0.0 == 0.0 and 1 == 1.0 == True in Python; constants must stay distinct.
    return (type(value), repr(value)) if isinstance(value, (float, int)) else value


def _sized_key(value: Any) -> Any:
    """_value_key that tells a Size from the plain int of its value, however deep in a
    load's index it is: a head dim of 64 and a sequence length of 64 are one int, but two
    different things to print."""
    if isinstance(value, Size):
        return (Size, size_value(value), value.text)
    if isinstance(value, tuple):
        return tuple(_sized_key(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (type(value), *(_sized_key(getattr(value, f.name)) for f in fields))
    return _value_key(value)


_INTERNED: weakref.WeakValueDictionary[Any, Expr] = weakref.WeakValueDictionary()

# The size symbols, with their values, of the graph being compiled. Interning keys compare
# values, and a Size equals its value: without this, a compile could take an expression
# another graph built with another symbol of equal value (a torch.compile graph's s27 in
# an export's s38), sound but printed with the foreign symbol, and its C would differ from
# its other sizes' (a build for nothing).
_sizes: contextvars.ContextVar[tuple[tuple[str, int], ...]] = contextvars.ContextVar(
    "opfuse_interned_sizes", default=()
)


@contextlib.contextmanager
def sized(symbols: tuple[tuple[str, int], ...]) -> Iterator[None]:
    """Intern expressions apart from those of graphs with other size symbols inside."""
    token = _sizes.set(symbols)
    try:
        yield
    finally:
        _sizes.reset(token)


def const(value: Any, dtype: torch.dtype) -> Expr:
    if dtype == torch.bool:
        value = bool(value)
    elif isinstance(value, Size):
        pass  # a symbolic size's value: printed as its expression, converted in C
    elif dtype.is_floating_point:
        value = float(value)
    else:
        value = int(value)
    return Expr("const", (), dtype, value)


def cast(x: Expr, dtype: torch.dtype) -> Expr:
    if x.dtype == dtype:
        return x
    if x.is_const:
        return const(x.value, dtype)
    return Expr("cast", (x,), dtype)


def _lift(x: Any, like: torch.dtype) -> Expr:
    """A Python number next to an Expr takes the Expr's dtype, as torch scalars do, except
    that a float number next to an integer Expr promotes to the default float dtype."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool):
        return const(x, like)
    if isinstance(x, float) and not like.is_floating_point:
        return const(x, torch.get_default_dtype())
    return const(x, like)


def _common(a: Expr, b: Expr) -> torch.dtype:
    return torch.promote_types(a.dtype, b.dtype)


def binary(op: str, a: Any, b: Any) -> Expr:
    if not isinstance(a, Expr):
        a = _lift(a, b.dtype)
    if not isinstance(b, Expr):
        b = _lift(b, a.dtype)
    t = _common(a, b)
    prim = PRIMS[op]
    if prim.float_only and not t.is_floating_point:
        t = torch.get_default_dtype()
    a, b = cast(a, t), cast(b, t)
    folded = _fold(op, (a, b))
    if folded is not None:
        return folded
    return Expr(op, (a, b), torch.bool if prim.result == "bool" else t)


def fma(a: Any, b: Any, c: Any) -> Expr:
    """a * b + c: rounded once for floats (C's fma), plain arithmetic for integers."""
    first = next(x for x in (a, b, c) if isinstance(x, Expr))
    a, b, c = (_lift(x, first.dtype) for x in (a, b, c))
    t = torch.promote_types(_common(a, b), c.dtype)
    return Expr("fma", (cast(a, t), cast(b, t), cast(c, t)), t)


def unary(op: str, a: Expr) -> Expr:
    prim = PRIMS[op]
    t = a.dtype
    if prim.float_only and not t.is_floating_point:
        t = torch.get_default_dtype()
    a = cast(a, t)
    return Expr(op, (a,), torch.bool if prim.result == "bool" else t)


def where(c: Any, a: Any, b: Any) -> Expr:
    if isinstance(c, bool):
        return a if c else b
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        raise TypeError("where() needs at least one Expr branch")
    if not isinstance(a, Expr):
        a = _lift(a, b.dtype)
    if not isinstance(b, Expr):
        b = _lift(b, a.dtype)
    t = _common(a, b)
    return Expr("where", (cast(c, torch.bool), cast(a, t), cast(b, t)), t)


def _fold(op: str, args: tuple[Expr, Expr]) -> Expr | None:
    """Drop the identities that formulas produce often (x*1, x+0) without changing
    semantics: x + 0.0 is not folded for floats because -0.0 + 0.0 is +0.0."""
    a, b = args
    if op == "mul" and b.is_const and b.value == 1:
        return a
    if op == "mul" and a.is_const and a.value == 1:
        return b
    if op in ("add", "sub") and b.is_const and b.value == 0 and not a.dtype.is_floating_point:
        return a
    if op == "div" and b.is_const and b.value == 1 and a.dtype.is_floating_point:
        return a
    return None


def call(op: str, *args: Any) -> Expr:
    """Apply primitive `op`; the generic entry point for formulas."""
    if op == "where":
        return where(*args)
    if op == "fma":
        return fma(*args)
    if PRIMS[op].arity == 1:
        return unary(op, args[0])
    return binary(op, args[0], args[1])


def position(index: Any) -> Expr:
    """The loop position itself (an Ix), as an int64 value: arange, iota."""
    return Expr("index", (), torch.int64, index)


def load(buffer: str, index: Any, dtype: torch.dtype) -> Expr:
    return Expr("load", (), dtype, (buffer, index))


def format_float(value: float) -> str:
    """A decimal literal that round-trips the value exactly (repr does)."""
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    return repr(float(value))


def walk(roots: list[Expr]) -> list[Expr]:
    """All subexpressions of `roots`, each once, operands before users."""
    order: list[Expr] = []
    seen: set[Expr] = set()
    stack: list[tuple[Expr, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        e, done = stack.pop()
        if done:
            if e not in seen:
                seen.add(e)
                order.append(e)
            continue
        if e in seen:
            continue
        stack.append((e, True))
        for a in reversed(e.args):
            if a not in seen:
                stack.append((a, False))
    return order


def substitute(e: Expr, subs: dict[Expr, Expr]) -> Expr:
    """e with every occurrence of a key of `subs` replaced by its value (outermost first;
    Exprs are hash-consed, so a dict finds them by identity)."""
    memo: dict[Expr, Expr] = {}

    def go(x: Expr) -> Expr:
        new = subs.get(x)
        if new is not None:
            return new
        hit = memo.get(x)
        if hit is None:
            hit = Expr(x.op, tuple(go(a) for a in x.args), x.dtype, x.value) if x.args else x
            memo[x] = hit
        return hit

    return go(e)


# Operations whose result has a fixed sign (NaN aside), and those whose result has the sign
# of their one operand.
_NONNEGATIVE = frozenset(
    {"exp", "exp2", "sqrt", "rsqrt", "abs", "sigmoid", "cosh", "erfc", "hypot"}
)
_ODD = frozenset(
    {"cast", "expm1", "tanh", "sinh", "atan", "asinh", "erf", "reciprocal", "trunc", "round"}
)


def sign(root: Expr) -> int:
    """+1 if `root` is >= 0 wherever it is finite, -1 if it is <= 0, 0 if either may be:
    a sum of terms of one sign cannot cancel. (Infinities are left out: 1 / -0.0 is -inf
    although -0.0 >= 0, and a sum with an infinite term is no question of accuracy.)"""
    s: dict[Expr, int] = {}
    for e in walk([root]):
        a = [s[x] for x in e.args]
        if e.op == "const":
            s[e] = 1 if e.value >= 0 else -1 if e.value < 0 else 0  # NaN: either
        elif e.op in _NONNEGATIVE:
            s[e] = 1
        elif e.op in _ODD:
            s[e] = a[0]
        elif e.op == "neg":
            s[e] = -a[0]
        elif e.op == "mul" and e.args[0] is e.args[1]:
            s[e] = 1
        elif e.op in ("mul", "div"):
            s[e] = a[0] * a[1]
        elif e.op == "add":
            s[e] = a[0] if a[0] == a[1] else 0
        elif e.op == "sub":
            s[e] = a[0] if a[0] == -a[1] else 0
        elif e.op in ("max", "fmax"):
            s[e] = 1 if 1 in a else -1 if a == [-1, -1] else 0
        elif e.op in ("min", "fmin"):
            s[e] = -1 if -1 in a else 1 if a == [1, 1] else 0
        elif e.op == "where":
            s[e] = a[1] if a[1] == a[2] else 0
        elif e.op == "pow":
            even = e.args[1].is_const and float(e.args[1].value) % 2 == 0
            s[e] = 1 if even or a[0] == 1 else 0
        else:
            s[e] = 0
    return s[root]
