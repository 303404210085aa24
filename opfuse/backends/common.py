"""What the C and Triton renderers share: index arithmetic as text, each backend with its
own syntax, and the naming of scalar expression DAGs. Formatting only."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..ir.index import Clamp, FloorDiv, Ix, Mod, Var
from ..ir.scalar import Expr, walk
from ..ir.size import is_size
from ..lower.kernel import Kernel


@dataclass(frozen=True)
class IndexSyntax:
    """Format strings of one backend: {x} an operand, {d} a divisor, {hi} a clamp's upper
    bound, {c}/{a} a coefficient and what it scales."""

    floordiv: str
    mod: str
    clamp: str
    scaled: str


def index_text(ix: Ix, syntax: IndexSyntax) -> str:
    parts = []
    for atom, c in ix.terms:
        if isinstance(atom, Var):
            a = atom.name
        elif isinstance(atom, FloorDiv):
            a = syntax.floordiv.format(x=index_text(atom.x, syntax), d=atom.d)
        elif isinstance(atom, Clamp):
            a = syntax.clamp.format(x=index_text(atom.x, syntax), hi=atom.hi)
        else:
            assert isinstance(atom, Mod)
            a = syntax.mod.format(x=index_text(atom.x, syntax), d=atom.d)
        parts.append(a if c == 1 else syntax.scaled.format(c=c, a=a))
    if ix.const or not parts:
        parts.append(str(ix.const))
    return " + ".join(parts)


class Namer:
    """Linearises Expr DAGs into statements, naming each value once per scope (the
    innermost scope is searched first). A backend says how a value reads (`text`), how a
    statement defining one reads (`assign`) and which values stay inline (`inline`)."""

    def __init__(self, scopes: list[dict[Expr, str]], counter: list[int]) -> None:
        self.scopes = scopes
        self.counter = counter

    def text(self, e: Expr) -> str:
        raise NotImplementedError

    def assign(self, name: str, e: Expr, text: str) -> str:
        raise NotImplementedError

    def inline(self, e: Expr) -> bool:
        return False

    def fresh(self) -> str:
        self.counter[0] += 1
        return f"t{self.counter[0]}"

    def lookup(self, e: Expr) -> str | None:
        for s in reversed(self.scopes):
            if e in s:
                return s[e]
        return None

    def ref(self, e: Expr) -> str:
        name = self.lookup(e)
        assert name is not None, f"{e!r} used before it was emitted"
        return name

    def emit(self, roots: Iterable[Expr], lines: list[str], indent: str) -> None:
        for e in walk(list(roots)):
            if self.lookup(e) is not None:
                continue
            text = self.text(e)
            if self.inline(e):
                self.scopes[-1][e] = text
                continue
            name = self.fresh()
            lines.append(f"{indent}{self.assign(name, e, text)}")
            self.scopes[-1][e] = name


def traffic(k: Kernel) -> str:
    """'reads R bytes, writes W bytes', for a kernel's comment. A count that is no Size in
    a kernel with symbolic sizes is this size's value only (a buffer whose sizes a
    rewrite could not keep as expressions): left out, or a comment alone would make each
    size's source, and so its build, its own."""
    symbolic = any(is_size(v.extent) for v in k.outer) or any(is_size(b.nbytes) for b in k.buffers)
    counts = (("reads", k.bytes_read), ("writes", k.bytes_written))
    return ", ".join(f"{w} {n} bytes" for w, n in counts if is_size(n) or not symbolic)
