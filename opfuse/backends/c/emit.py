"""C building blocks shared by the kernel renderers: type names, literals, conversions
with torch's semantics, index arithmetic, and the Emitter that linearises scalar
expression DAGs into named C values. Formatting only."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...ir.index import Ix, Var
from ...ir.scalar import PRIMS, Expr, format_float, walk
from ...ir.size import is_size
from ...lower.kernel import Kernel, Store
from ..common import IndexSyntax, Namer, index_text

CTYPE = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "_Float16",
    torch.bfloat16: "bf16_t",
    torch.int8: "int8_t",
    torch.int16: "int16_t",
    torch.int32: "int32_t",
    torch.int64: "int64_t",
    torch.uint8: "uint8_t",
    torch.bool: "bool",
}
_INT_LIMITS = {
    torch.int8: ("INT8_MIN", "INT8_MAX"),
    torch.int16: ("INT16_MIN", "INT16_MAX"),
    torch.int32: ("INT32_MIN", "INT32_MAX"),
    torch.int64: ("INT64_MIN", "INT64_MAX"),
    torch.uint8: ("0", "UINT8_MAX"),
    torch.bool: ("0", "1"),
}
# Booleans are stored as bytes (torch's layout) and held as int: gcc vectorises loops that
# mix 1-byte _Bool with float badly (it picks 8-byte vectors), and an int 0/1 is a _Bool.
STORAGE = {**CTYPE, torch.bool: "uint8_t"}
VALUE = {**CTYPE, torch.bool: "int"}


def ctype(dtype: torch.dtype) -> str:
    return CTYPE[dtype]


def literal(value: object, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "1" if value else "0"
    if is_size(value):  # (its expression while symbolic text is printed, else its value)
        return convert(f"({value})", torch.int64, dtype)
    if dtype.is_floating_point:
        text = format_float(float(value))  # type: ignore[arg-type]
        if dtype == torch.float64:
            return text
        f32 = text if not text[-1].isdigit() else text + "f"
        if dtype == torch.float32:
            return f32
        if dtype == torch.float16:
            return f"((_Float16){f32})"
        return f"f32_to_bf16({f32})"
    v = int(value)  # type: ignore[call-overload]
    if v == -(2**63):
        return "INT64_MIN"
    return f"(({CTYPE[dtype]}){v}LL)" if abs(v) > 2**31 - 1 else f"(({CTYPE[dtype]}){v})"


def convert(x: str, src: torch.dtype, dst: torch.dtype) -> str:
    """C expression converting `x` from src to dst with torch's semantics."""
    if src == dst:
        return x
    if src == torch.bfloat16:
        x, src = f"bf16_to_f32({x})", torch.float32
        if dst == torch.float32:
            return x
    if dst == torch.bool:
        return f"(({x}) != 0)"
    if dst == torch.bfloat16:
        return f"f32_to_bf16((float)({x}))"
    return f"(({CTYPE[dst]})({x}))"


_INDEX = IndexSyntax(
    floordiv="(({x}) / {d})",
    mod="(({x}) % {d})",
    clamp="(({x}) < 0 ? 0 : ({x}) > {hi} ? {hi} : ({x}))",
    scaled="{c}*{a}",
)


def index(ix: Ix) -> str:
    return index_text(ix, _INDEX)


class Emitter(Namer):
    """Linearises Expr DAGs into C statements, naming each value once per scope."""

    def inline(self, e: Expr) -> bool:
        return e.op == "const"

    def assign(self, name: str, e: Expr, text: str) -> str:
        return f"const {VALUE[e.dtype]} {name} = {text};"

    def registers(self, staged: dict[Expr, str], lines: list[str], indent: str) -> dict[Expr, str]:
        """Read each staged element into a named value at the top of the vector loop's body:
        left as an array read inside `c ? a : b` (a cat, a pad), gcc will not if-convert
        the select and the whole loop, its math included, stays scalar."""
        out: dict[Expr, str] = {}
        for e, ref in staged.items():
            name = self.fresh()
            lines.append(f"{indent}const {VALUE[e.dtype]} {name} = {ref};")
            out[e] = name
        return out

    def text(self, e: Expr) -> str:
        if e.op == "const":
            return literal(e.value, e.dtype)
        if e.op == "load":
            buf, ix = e.value
            return f"{buf}[{index(ix)}]"
        if e.op == "acc":
            name, part = e.value
            return f"{name}_{part}"
        if e.op == "index":
            return f"((int64_t)({index(e.value)}))"
        if e.op == "cast":
            return convert(self.ref(e.args[0]), e.args[0].dtype, e.dtype)
        prim = PRIMS[e.op]
        operand = e.args[0].dtype if e.op != "where" else e.args[1].dtype
        tmpl = prim.c if operand.is_floating_point or prim.c_int is None else prim.c_int
        return tmpl.format(
            *(self.ref(a) for a in e.args),
            f="f" if operand == torch.float32 else "",
            T=CTYPE[operand],
        )


def for_loop(v: Var, indent: str) -> str:
    return f"{indent}for (int64_t {v.name} = 0; {v.name} < {v.extent}; {v.name}++) {{"


def emit_stores(em: Emitter, stores: Sequence[Store], lines: list[str], indent: str) -> None:
    em.emit([s.value for s in stores], lines, indent)
    for s in stores:
        store = f"{s.buffer}[{index(s.index)}] = {em.ref(s.value)};"
        if s.guard is not None:
            store = f"if (({index(s.guard)}) == 0) {store}"
        lines.append(f"{indent}{store}")


def emit_checks(em: Emitter, k: Kernel, lines: list[str], indent: str) -> None:
    em.emit(k.checks, lines, indent)
    for c in k.checks:
        lines.append(f"{indent}err |= {em.ref(c)};")


def loop_vars(e: Expr) -> set[str]:
    """Loop variables an expression depends on (through its loads and positions)."""
    out: set[str] = set()
    for s in walk([e]):
        if s.op == "load":
            out |= {v.name for v in s.value[1].variables()}
        elif s.op == "index":
            out |= {v.name for v in s.value.variables()}
    return out


def invariant(roots: Sequence[Expr], loops: Sequence[Var]) -> list[Expr]:
    """Subexpressions that do not change inside `loops`: computed once, before them
    (a scalar load in a vector loop can otherwise keep gcc from vectorising it)."""
    names = {v.name for v in loops}
    memo: dict[Expr, bool] = {}
    out = []
    for e in walk(list(roots)):
        if e.op == "const":
            continue
        if e.args:
            varying = any(memo.get(a, False) for a in e.args)
        else:
            varying = bool(loop_vars(e) & names)
        memo[e] = varying
        if not varying:
            out.append(e)
    return out


# Elements of a gathered operand copied per chunk of a vector loop (stack arrays).
STAGE = 256


def gathered(em: Emitter, roots: Sequence[Expr], lanes: Sequence[str]) -> list[Expr]:
    """Loads a vector loop over `lanes` would gather, lane by lane: with one lane variable,
    those whose address moves by other than one element per step; with several (loops
    flattened into the lanes), every load that reads through any of them. Loads an
    enclosing loop already staged (a whole row, see reductions._stage_row) are not listed."""
    names = set(lanes)

    def moves(ix: Ix) -> bool:
        if len(names) > 1:
            return bool(names & {v.name for v in ix.variables()})
        for atom, c in ix.terms:
            if isinstance(atom, Var):
                if atom.name in names and c != 1:
                    return True
            elif names & {v.name for v in atom.x.variables()}:
                return True
        return False

    return [
        e
        for e in walk(list(roots))
        if e.op == "load" and moves(e.value[1]) and em.lookup(e) is None
    ]


def stage(
    em: Emitter,
    loads: Sequence[Expr],
    var: str,
    loop: tuple[str, str | None, str, int],
    lines: list[str],
    indent: str,
) -> dict[Expr, str]:
    """Copy `loads` into contiguous stack arrays in a vector loop of their own: `loop` is
    (its header, a first statement of its body or None, the array slot of an iteration,
    the most iterations). Returns where the vector loop that follows finds each value."""
    header, first, slot, size = loop
    names = [f"{var}_s{j}" for j in range(len(loads))]
    for name, ld in zip(names, loads):
        lines.append(f"{indent}{STORAGE[ld.dtype]} {name}[{size}];")
    lines.append(f"{indent}#pragma omp simd")
    lines.append(f"{indent}{header}")
    if first is not None:
        lines.append(f"{indent}  {first}")
    for name, ld in zip(names, loads):
        lines.append(f"{indent}  {name}[{slot}] = {em.text(ld)};")
    lines.append(f"{indent}}}")
    return {ld: f"{name}[{slot}]" for name, ld in zip(names, loads)}


def simd_loop(
    em: Emitter,
    roots: Sequence[Expr],
    var: str,
    bounds: tuple[str, str],
    pragma: str,
    lines: list[str],
    indent: str,
    body: Callable[[str], None],
    span: int | None = None,
) -> None:
    """`for (var = start; var < stop; var++)` under `#pragma omp {pragma}`, its statements
    written by body(indent). An operand the loop would gather (a channels-last tensor read
    next to an NCHW one) is first copied into a contiguous stack array, STAGE elements at a
    time, so that the vector math reads it with unit stride. Measured: a mish backward over
    8x32x64x64 mixing the layouts 26 -> 1.7 ms; sum(a * sigmoid(b) * b, (2, 3)) with `a`
    channels-last 85 -> 0.8 ms (16 lanes gathering 4 KiB apart, from one L1 set).
    `span`: the loop runs at most this many times, staged whole without a chunk loop. A
    reduction must be staged so: gcc 12 does not vectorise a simd reduction nested in the
    chunk loop, and its float32 runs then sum one element after another (measured on a
    BatchNorm backward: 16 ulps off instead of 2)."""
    start, stop = bounds
    staged = gathered(em, roots, [var])
    chunked = bool(staged) and span is None
    ind, c, bound = indent, start, {}
    if chunked:
        c, e = f"{var}_c", f"{var}_e"
        lines.append(f"{indent}for (int64_t {c} = {start}; {c} < {stop}; {c} += {STAGE}) {{")
        ind = indent + "  "
        lines.append(f"{ind}const int64_t {e} = {c} + {STAGE} < {stop} ? {c} + {STAGE} : {stop};")
        stop = e
    header = f"for (int64_t {var} = {c}; {var} < {stop}; {var}++) {{"
    if staged:
        bound = stage(em, staged, var, (header, None, f"{var} - {c}", span or STAGE), lines, ind)
    lines.append(f"{ind}#pragma omp {pragma}")
    lines.append(f"{ind}{header}")
    em.scopes.append(em.registers(bound, lines, ind + "  "))
    body(ind + "  ")
    em.scopes.pop()
    lines.append(f"{ind}}}")
    if chunked:
        lines.append(f"{indent}}}")
