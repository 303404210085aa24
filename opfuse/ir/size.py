"""Sizes that know which symbolic size they came from.

A graph dynamo hands over with symbolic sizes (`s0`) is still compiled per size, but its
kernels need not be: a `Size` is an int (its value at the size being compiled, which every
decision reads as any int) that also carries a C expression of the graph's size symbols.
While C is rendered (`symbolic_text()`), printing a Size prints that expression, and the
kernel takes the symbols it printed as arguments (the C backend binds each expression to a
local on entry, `hoist`). Every size of the graph then renders the same source wherever
its decisions came out the same, and the source is built once (the build cache is keyed
by the source).

Why this is sound whatever the decisions were: each size renders its own source, in which
every printed expression evaluates, with the symbol values the kernel is passed (those of
the Sizes it printed, never two for one symbol), to the value Python used. Two sizes share
a library only when their sources are equal text, so the library computes, for each of
them, what its own source does. Arithmetic on Sizes keeps the expression (+, -, *, //, %,
negation, divmod, abs; min/max return an operand); anything else (true division, bit
operations) yields a plain int, printed as its value: correct, merely specific to that
size.

A compile can also serve other sizes without compiling (runtime/sized.py) when it records
its decisions (`deciding()`): every comparison of a Size with another number, and every
value given up (int(size), size / 2, bit operations: recorded as "equals this value"), as
expression text and outcome. Where every recorded decision comes out the same at other
symbol values, the compile would decide the same there; where one does not, `otherwise`
names those that differ and the function that took each.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import math
import operator
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class Printed(dict[str, Any]):
    """The symbols printed while rendering, with their values; `valued` is set when a Size
    printed as its value (one whose symbols had printed with other values: an expression
    interned by the compile of another size)."""

    valued: bool = False
    # expression text -> the name of a local it is bound to once at the kernel's top
    # (symbolic_text(hoist=True)), or None: print expressions where they stand
    hoisted: dict[str, str] | None = None


# symbol -> value of every Size printed while rendering, or None: print values
_printing: contextvars.ContextVar[Printed | None] = contextvars.ContextVar(
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


_OPS: dict[str, Any] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}


class Decisions:
    """The decisions a compile took from the values of Sizes: (expression, operator,
    other operand) -> outcome, the operands as Python expression text over the symbols'
    C names."""

    def __init__(self) -> None:
        self.outcomes: dict[tuple[str, str, str], bool] = {}
        self.sites: dict[tuple[str, str, str], str] = {}  # where each was taken (module.function)
        self.check: Any = None  # (compiled once from the outcomes: hold())
        # what no expression says: a test of the symbols' values, true where the decision
        # comes out the same (a meta inferred by trial runs: the op's meta run there)
        self.tests: list[Callable[[Mapping[str, int]], bool]] = []

    def note(self, left: str, op: str, right: str, outcome: bool) -> None:
        key = (left, op, right)
        if key not in self.outcomes:
            self.outcomes[key] = outcome
            self.sites[key] = _site()
            self.check = None

    def test(self, holds: Callable[[Mapping[str, int]], bool]) -> None:
        """Record a decision as a test of the symbols' values (by C name)."""
        self.tests.append(holds)

    def __len__(self) -> int:
        return len(self.outcomes) + len(self.tests)

    def merge(self, other: Decisions) -> None:
        """Take `other`'s decisions as this compile's too."""
        for key, outcome in other.outcomes.items():
            if key not in self.outcomes:
                self.outcomes[key] = outcome
                self.sites[key] = other.sites[key]
                self.check = None
        self.tests += other.tests

    def otherwise(self, values: Mapping[str, int]) -> list[str]:
        """The decisions that come out otherwise at `values`, each as its comparison and
        where the compile took it (for the report: why a size compiled again)."""
        out = []
        for (a, op, b), outcome in self.outcomes.items():
            try:
                same = eval(_code(_term(a, op, b, outcome)), _EVAL_GLOBALS, dict(values))
            except (NameError, ArithmeticError, ValueError, TypeError):
                same = False
            if not same:
                shown = readable(f"{a} {op} {b}")
                out.append(f"`{shown}` ({self.sites.get((a, op, b), '?')})")
        for holds in self.tests:
            if not holds(values):
                out.append(f"a meta tried at these sizes ({getattr(holds, '__qualname__', holds)})")
        return out

    def hold(self, values: Mapping[str, int]) -> bool:
        """Would every decision come out the same with the symbols at `values` (by C
        name)? A symbol not in `values`: no."""
        if self.check is None:
            terms = [_term(a, op, b, outcome) for (a, op, b), outcome in self.outcomes.items()]
            self.check = compile(" and ".join(terms) or "True", "<decisions>", "eval")
        try:
            if not eval(self.check, _EVAL_GLOBALS, dict(values)):
                return False
        except (NameError, ArithmeticError, ValueError, TypeError):
            return False
        return all(holds(values) for holds in self.tests)


def readable(text: str) -> str:
    """A decision's expression as a person reads it: the symbols' bare names, floor
    division and modulo as operators, -(-a // b) as ceil(a / b), and what at_least and
    either compute as a comparison and a conditional (exact for sizes, which are >= 0)."""
    bare = text.replace(PREFIX, "")
    try:
        tree = ast.parse(bare, mode="eval")
    except SyntaxError:
        return bare
    return ast.unparse(_Readable().visit(tree))


def _is_int(node: ast.AST, v: int) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value == v


def _binop(node: ast.AST, op: type[ast.operator]) -> ast.BinOp | None:
    return node if isinstance(node, ast.BinOp) and isinstance(node.op, op) else None


class _Readable(ast.NodeTransformer):
    """readable's rewrites, innermost first (what at_least makes is a comparison by the
    time either's pattern is looked for)."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        ops = {"floordiv": ast.FloorDiv, "floormod": ast.Mod}
        if isinstance(node.func, ast.Name) and node.func.id in ops and len(node.args) == 2:
            return ast.BinOp(node.args[0], ops[node.func.id](), node.args[1])
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        div = _binop(node.operand, ast.FloorDiv)
        inner = div.left if div is not None else None
        if (  # -(-a // b)
            div is not None
            and isinstance(node.op, ast.USub)
            and isinstance(inner, ast.UnaryOp)
            and isinstance(inner.op, ast.USub)
        ):
            true_div = ast.BinOp(inner.operand, ast.Div(), div.right)
            return ast.Call(ast.Name("ceil", ast.Load()), [true_div], [])
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        # at_least: 1 - 1 // (x // bound + 1), x // 1 printed as x
        div = _binop(node.right, ast.FloorDiv) if _binop(node, ast.Sub) else None
        plus = _binop(div.right, ast.Add) if div is not None and _is_int(div.left, 1) else None
        if _is_int(node.left, 1) and plus is not None and _is_int(plus.right, 1):
            x = _binop(plus.left, ast.FloorDiv)
            x_bound = (x.left, x.right) if x is not None else (plus.left, ast.Constant(1))
            return ast.Compare(x_bound[0], [ast.GtE()], [x_bound[1]])
        # either: flag * a + (1 - flag) * b
        left, right = _binop(node.left, ast.Mult), _binop(node.right, ast.Mult)
        if _binop(node, ast.Add) and left is not None and right is not None:
            not_flag = _binop(right.left, ast.Sub)
            if (
                isinstance(left.left, ast.Compare)
                and not_flag is not None
                and _is_int(not_flag.left, 1)
                and ast.dump(not_flag.right) == ast.dump(left.left)
            ):
                return ast.IfExp(left.left, left.right, right.right)
        return node


def _term(a: str, op: str, b: str, outcome: bool) -> str:
    """A decision as Python text, true where it comes out as it did."""
    return f"(({a}) {op} ({b})) is {outcome}"


_deciding: contextvars.ContextVar[Decisions | None] = contextvars.ContextVar(
    "opfuse_size_deciding", default=None
)


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[Any], value: T) -> Iterator[T]:
    """`var` set to `value` inside (yielded), as it was after."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def deciding() -> contextlib.AbstractContextManager[Decisions]:
    """Record the decisions taken from Sizes inside."""
    return scoped(_deciding, Decisions())


def recording(log: Decisions | None) -> contextlib.AbstractContextManager[Decisions | None]:
    """Record the decisions taken inside in `log` (None: where they are recorded now): a
    candidate implementation's own, which count only if it is chosen (adopt)."""
    return scoped(_deciding, log) if log is not None else contextlib.nullcontext()


def adopt(log: Decisions | None) -> None:
    """`log`'s decisions (a chosen candidate's: recording) as those of the compile."""
    now = _deciding.get()
    if now is not None and log is not None and log is not now:
        now.merge(log)


def at_least(x: int, bound: int) -> int:
    """1 where x >= bound (> 0), else 0, for x >= 0: an expression of a Size that decides
    nothing (the kernel computes which side it is on as it runs)."""
    if not isinstance(x, Size):
        return int(x >= bound)
    return 1 - 1 // (x // bound + 1)


def either(flag: int, a: int, b: int) -> int:
    """a where flag (0 or 1, at_least's) is 1, else b: one expression for both."""
    return flag * a + (1 - flag) * b


def decisions() -> Decisions | None:
    """The decisions being recorded (deciding()), or None."""
    return _deciding.get()


def undecided() -> contextlib.AbstractContextManager[None]:
    """Comparisons inside decide no correctness, only cost (which pooled block a buffer
    takes): not recorded, and what they chose must hold at every size by itself."""
    return scoped(_deciding, None)


def _site() -> str:
    """module.function of the first caller outside this module (`lower/gemm_tiles.tiles`)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    parts = frame.f_code.co_filename.removesuffix(".py").split(os.sep)
    inside = len(parts) - parts[::-1].index("opfuse") if "opfuse" in parts else len(parts) - 2
    return f"{'/'.join(parts[inside:])}.{frame.f_code.co_name}"


def _text(x: Any) -> str:
    return x.text if isinstance(x, Size) else repr(x)


def _comparison(op: str, base: Any) -> Any:
    """A comparison of a Size that records its outcome inside deciding()."""

    def method(self: Size, other: Any) -> Any:
        outcome = base(self, other)
        if outcome is NotImplemented:
            if not isinstance(other, float):
                return outcome
            outcome = _OPS[op](int.__int__(self), other)
        log = _deciding.get()
        if log is not None:
            log.note(self.text, op, _text(other), outcome)
        return outcome

    return method


def _given_up(*xs: Any) -> None:
    """Sizes whose values leave as plain numbers: recorded as decided (equal to it)."""
    log = _deciding.get()
    if log is not None:
        for x in xs:
            if isinstance(x, Size):
                log.note(x.text, "==", int.__repr__(x), True)


def _valued(base: Any) -> Any:
    """An int operation of a Size that yields no Size: its operands' values are decided."""

    def method(self: Size, *args: Any) -> Any:
        _given_up(self, *args)
        return base(
            int.__int__(self), *(int.__int__(a) if isinstance(a, Size) else a for a in args)
        )

    return method


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
        return (int, (value(self),))

    # -- printing ------------------------------------------------------------------------
    def _shown(self) -> str:
        seen = _printing.get()
        if seen is None:
            return int.__repr__(self)
        if any(seen.get(n, v) != v for n, v in self.leaves):
            # A Size of another size where one symbol already printed with a different
            # value (an interned expression of an earlier compile, equal in value): the
            # value is what is meant.
            seen.valued = True
            return int.__repr__(self)
        for name, value in self.leaves:
            seen.setdefault(name, value)
        if seen.hoisted is None or (len(self.leaves) == 1 and self.text == self.leaves[0][0]):
            return self.text
        # bound once per call: the expression may sit in an innermost loop, where nested
        # floor divisions (with their sign tests) would be computed for every element
        return seen.hoisted.setdefault(self.text, f"{PREFIX}_h{len(seen.hoisted)}")

    def __repr__(self) -> str:
        return self._shown()

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        if not spec:
            return self._shown()
        _given_up(self)
        return int.__format__(value(self), spec)

    # -- arithmetic keeps the expression -------------------------------------------------
    __add__, __radd__ = _operator("+", int.__add__)
    __sub__, __rsub__ = _operator("-", int.__sub__)
    __mul__, __rmul__ = _operator("*", int.__mul__)
    __floordiv__, __rfloordiv__ = _operator("//", int.__floordiv__)
    __mod__, __rmod__ = _operator("%", int.__mod__)

    def __neg__(self) -> Any:
        return Size(-value(self), f"(-{self.text})", self.leaves)

    def __pos__(self) -> Any:
        return self

    # -- decisions (recorded inside deciding()) -----------------------------------------
    __lt__ = _comparison("<", int.__lt__)
    __le__ = _comparison("<=", int.__le__)
    __gt__ = _comparison(">", int.__gt__)
    __ge__ = _comparison(">=", int.__ge__)
    __eq__ = _comparison("==", int.__eq__)
    __ne__ = _comparison("!=", int.__ne__)
    __hash__ = int.__hash__

    def __bool__(self) -> bool:
        return bool(self != 0)

    def __abs__(self) -> Any:
        return self if self >= 0 else -self

    def __divmod__(self, other: Any) -> Any:
        return (self // other, self % other) if isinstance(other, int) else NotImplemented

    def __rdivmod__(self, other: Any) -> Any:
        return (other // self, other % self) if isinstance(other, int) else NotImplemented

    # what yields a plain int (or float) gives the expression up: this value is decided
    __int__ = _valued(int.__int__)
    __index__ = _valued(int.__index__)
    __float__ = _valued(int.__float__)
    __truediv__, __rtruediv__ = _valued(int.__truediv__), _valued(int.__rtruediv__)
    __pow__, __rpow__ = _valued(int.__pow__), _valued(int.__rpow__)
    __and__, __rand__ = _valued(int.__and__), _valued(int.__rand__)
    __or__, __ror__ = _valued(int.__or__), _valued(int.__ror__)
    __xor__, __rxor__ = _valued(int.__xor__), _valued(int.__rxor__)
    __lshift__, __rlshift__ = _valued(int.__lshift__), _valued(int.__rlshift__)
    __rshift__, __rrshift__ = _valued(int.__rshift__), _valued(int.__rrshift__)
    __invert__ = _valued(int.__invert__)
    __round__ = _valued(int.__round__)
    __trunc__ = _valued(int.__trunc__)
    __floor__ = _valued(int.__floor__)
    __ceil__ = _valued(int.__ceil__)
    bit_length = _valued(int.bit_length)


def value(x: int) -> int:
    """x as a plain int, deciding nothing (for keys and bookkeeping that keep the
    expression beside it)."""
    return int.__int__(x)


def value_at(x: int, values: Mapping[str, int]) -> int:
    """x's value where the size symbols take `values` (by C name; a symbol not named keeps
    its own); a plain int is itself."""
    if not isinstance(x, Size):
        return int(x)
    env = {n: values.get(n, v) for n, v in x.leaves}
    return int(eval(_code(x.text), _EVAL_GLOBALS, env))  # our own expression text


def at(x: int, values: Mapping[str, int]) -> int:
    """x where the size symbols take `values`: a Size of the same expression with that
    value (a plain int stays)."""
    if not isinstance(x, Size):
        return x
    leaves = tuple((n, values.get(n, v)) for n, v in x.leaves)
    return Size(value_at(x, values), x.text, leaves)


@functools.lru_cache(maxsize=4096)
def _code(text: str) -> Any:
    return compile(text, "<size>", "eval")


_EVAL_GLOBALS: dict[str, Any] = {
    "__builtins__": {},
    "opfuse_floordiv": operator.floordiv,
    "opfuse_floormod": operator.mod,
    "opfuse_gcd": math.gcd,  # (in decisions only: never printed into C)
}


def gcd(a: int, b: int) -> int:
    """math.gcd that returns an operand (a Size keeps its expression) when it is the
    result."""
    g = math.gcd(a, b)
    same = next((x for x in (a, b) if isinstance(x, Size) and value(x) == g), None)
    log = _deciding.get()
    if log is not None and (isinstance(a, Size) or isinstance(b, Size)):
        log.note(f"opfuse_gcd({_text(a)}, {_text(b)})", "==", _text(same or g), True)
    return same if same is not None else g


def is_size(x: object) -> bool:
    """Is x a Size (an int that prints as an expression of size symbols)?"""
    return isinstance(x, Size)


def _combine(a: Any, b: Any, op: str, fn: Any) -> Any:
    # (hot: tens of thousands of calls a compile; each test done once)
    if not (isinstance(a, int) and isinstance(b, int)) or bool in (a.__class__, b.__class__):
        if isinstance(a, (float, bool)) or isinstance(b, (float, bool)):
            _given_up(a, b)  # (float's and int's own operators read the value unrecorded)
        return NotImplemented
    sa, sb = isinstance(a, Size), isinstance(b, Size)
    ia, ib = int.__int__(a), int.__int__(b)
    value = fn(ia, ib)
    if not (sa or sb):
        return value
    # identities keep expressions short (and equal across sizes where they apply alike)
    if not sb and ((ib == 0 and op in ("+", "-")) or (ib == 1 and op in ("*", "//"))):
        return a
    if not sa and ((ia == 0 and op == "+") or (ia == 1 and op == "*")):
        return b
    if op == "*" and ((not sa and ia == 0) or (not sb and ib == 0)):
        return value  # a constant 0: 0 whatever the other operand is (not a Size that is
        # 0 at this size: m // 64 is not 0 at every size)
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


def symbolic_text(hoist: bool = False) -> contextlib.AbstractContextManager[Printed]:
    """Print Sizes as their expressions inside; yields the symbols printed, with values.
    With `hoist`, an expression of symbols prints as the name of a local (`hoisted`:
    expression -> name) that the caller declares where the symbols are read."""
    printed = Printed()
    if hoist:
        printed.hoisted = {}
    return scoped(_printing, printed)


def bindings(printed: Printed, used: str) -> str:
    """C declarations of the locals `printed` hoisted that `used` names, to follow the
    symbols' own (every expression reads symbols alone)."""
    if not printed.hoisted:
        return ""
    named = set(_HOISTED.findall(used))
    return "".join(
        f"\n  const int64_t {name} = {text};"
        for text, name in printed.hoisted.items()
        if name in named
    )


def unhoisted(printed: Printed, text: str) -> str:
    """`text` with the hoisted locals' names written as their expressions."""
    names = {name: expr for expr, name in (printed.hoisted or {}).items()}
    return _HOISTED.sub(lambda m: names[m.group(0)], text) if names else text


_HOISTED = re.compile(rf"\b{PREFIX}_h\d+\b")  # a hoisted local's name


# C helpers the expressions call: floor division and modulo as Python defines them (C's
# truncate toward zero). A zero divisor gives 0: hoisted expressions are computed on entry,
# also those only a loop that runs no iteration at this size would have reached.
C_HELPERS = r"""
static inline int64_t opfuse_floordiv(int64_t a, int64_t b) {
  if (b == 0) return 0;
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline int64_t opfuse_floormod(int64_t a, int64_t b) {
  if (b == 0) return 0;
  int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
"""
