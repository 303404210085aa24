"""Kernel -> C source with OpenMP. Formatting only: every semantic choice was made in
lowering; formulas come from the primitive table (ir.scalar.PRIMS) and conversions from
the tables below.

Each kernel becomes `int NAME(void *const *args, int nthreads)` returning 0, or 1 when an
integer division by zero happened (torch raises ZeroDivisionError there).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ...ir.index import FloorDiv, Ix, Mod, Var
from ...ir.scalar import PRIMS, Expr, format_float, walk
from ...lower.kernel import Accumulate, Kernel, Pass, Store

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
LANES = 16  # accumulator lanes per reduction: one 512-bit register of float32
# Welford's updates depend on the previous ones: 64 lanes (8 registers of float64 for the
# mean, 8 for m2) keep enough independent chains in flight to hide the latency.
WELFORD_LANES = 64


def lanes_for(accs: Sequence[Accumulate]) -> int:
    return WELFORD_LANES if any(a.combine == "welford" for a in accs) else LANES


COLUMN_LANES = 64  # outputs per block in the columns schedule: 4 cache lines of float32
PARALLEL_MIN = 1 << 15  # fewer elements than this run on one thread


def ctype(dtype: torch.dtype) -> str:
    return CTYPE[dtype]


def literal(value: object, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "1" if value else "0"
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


def index(ix: Ix) -> str:
    parts = []
    for atom, c in ix.terms:
        if isinstance(atom, Var):
            a = atom.name
        elif isinstance(atom, FloorDiv):
            a = f"(({index(atom.x)}) / {atom.d})"
        else:
            assert isinstance(atom, Mod)
            a = f"(({index(atom.x)}) % {atom.d})"
        parts.append(a if c == 1 else f"{c}*{a}")
    if ix.const or not parts:
        parts.append(str(ix.const))
    return " + ".join(parts)


class Emitter:
    """Linearises Expr DAGs into C statements, naming each value once per scope."""

    def __init__(self, scopes: list[dict[Expr, str]], counter: list[int]) -> None:
        self.scopes = scopes
        self.counter = counter

    def lookup(self, e: Expr) -> str | None:
        for s in reversed(self.scopes):
            if e in s:
                return s[e]
        return None

    def emit(self, roots: Iterable[Expr], lines: list[str], indent: str) -> None:
        for e in walk(list(roots)):
            if self.lookup(e) is not None:
                continue
            text = self.text(e)
            if e.op == "const":
                self.scopes[-1][e] = text
                continue
            self.counter[0] += 1
            name = f"t{self.counter[0]}"
            lines.append(f"{indent}const {VALUE[e.dtype]} {name} = {text};")
            self.scopes[-1][e] = name

    def ref(self, e: Expr) -> str:
        name = self.lookup(e)
        assert name is not None, f"{e!r} used before it was emitted"
        return name

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


def render_module(kernels: Sequence[tuple[str, Kernel]]) -> str:
    """One translation unit holding every kernel of a graph (the builder prepends the
    prelude that fits its toolchain, see prelude.py)."""
    return "\n".join(render_kernel(name, k) for name, k in kernels)


def _header(name: str, k: Kernel) -> list[str]:
    ops = ", ".join(dict.fromkeys(k.ops))
    return [
        f"/* {k.name}: {ops}",
        f" * schedule {k.schedule}; reads {k.bytes_read} bytes, writes {k.bytes_written} bytes */",
        f"int {name}(void *const *args, int nthreads) {{",
    ]


def render_kernel(name: str, k: Kernel) -> str:
    lines = _header(name, k)
    shared = {name for pair in k.inplace for name in pair}  # may alias: no restrict
    for i, b in enumerate(k.buffers):
        const = "const " if b.role == "in" else ""
        t = STORAGE[b.dtype]
        if b.name in shared:
            lines.append(f"  {const}{t} *{b.name} = ({const}{t} *)args[{i}];")
            continue
        lines.append(f"  {const}{t} *restrict {b.name} = ({const}{t} *)args[{i}];")
    lines.append("  int err = 0;")
    lines.append("  (void)nthreads;")
    if k.schedule == "pointwise":
        _pointwise(k, lines)
    elif k.schedule == "rows":
        _rows(k, lines)
    elif k.schedule == "columns":
        _columns(k, lines)
    else:
        _split(k, lines)
    lines.append("  return err;")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _loop(v: Var, indent: str) -> str:
    return f"{indent}for (int64_t {v.name} = 0; {v.name} < {v.extent}; {v.name}++) {{"


def _stores(em: Emitter, stores: Sequence[Store], lines: list[str], indent: str) -> None:
    em.emit([s.value for s in stores], lines, indent)
    for s in stores:
        store = f"{s.buffer}[{index(s.index)}] = {em.ref(s.value)};"
        if s.guard is not None:
            store = f"if (({index(s.guard)}) == 0) {store}"
        lines.append(f"{indent}{store}")


def _checks(em: Emitter, k: Kernel, lines: list[str], indent: str) -> None:
    em.emit(k.checks, lines, indent)
    for c in k.checks:
        lines.append(f"{indent}err |= {em.ref(c)};")


def _pointwise(k: Kernel, lines: list[str]) -> None:
    p = k.passes[0]
    total = k.outer_size
    red = " reduction(|:err)" if k.checks else ""
    em = Emitter([{}], [0])
    if not k.outer:
        _stores(em, p.stores, lines, "  ")
        _checks(em, k, lines, "  ")
        return
    par = f"num_threads(nthreads) schedule(static) if({total} >= {PARALLEL_MIN}){red}"
    if len(k.outer) == 1:
        lines.append(f"  #pragma omp parallel for simd {par}")
    else:
        lines.append(f"  #pragma omp parallel for collapse({len(k.outer) - 1}) {par}")
    indent = "  "
    for i, v in enumerate(k.outer):
        if i == len(k.outer) - 1 and len(k.outer) > 1:
            # what the vector loop does not change is computed before it
            em.scopes.append({})
            em.emit(_invariant([s.value for s in p.stores], [v]), lines, indent)
            lines.append(f"{indent}#pragma omp simd{red}")
        lines.append(_loop(v, indent))
        indent += "  "
    em.scopes.append({})
    _stores(em, p.stores, lines, indent)
    _checks(em, k, lines, indent)
    for _ in k.outer:
        indent = indent[:-2]
        lines.append(f"{indent}}}")


# -- reductions ----------------------------------------------------------------------------
# Naming: lane arrays NAME_L.. (one slot per lane), combined results NAME_value / _index /
# _mean / _m2 / _cnt, per-thread partials NAME_P.. (split schedule).
def _lane_fields(a: Accumulate) -> list[tuple[str, str, str]]:
    """(suffix, C type, initial value) of each lane array."""
    t = a.acc_dtype
    ct = VALUE[t]
    if a.combine == "sum" or a.combine == "any":
        return [("", ct, "0")]
    if a.combine == "prod" or a.combine == "all":
        return [("", ct, "1")]
    if a.combine in ("max", "argmax"):
        lo = "(-INFINITY)" if t.is_floating_point else _INT_LIMITS[t][0]
        if a.combine == "max":
            return [("", ct, lo)]
        return [("v", ct, lo), ("i", "int64_t", "INT64_MAX")]
    if a.combine in ("min", "argmin"):
        hi = "INFINITY" if t.is_floating_point else _INT_LIMITS[t][1]
        if a.combine == "min":
            return [("", ct, hi)]
        return [("v", ct, hi), ("i", "int64_t", "INT64_MAX")]
    return [("mean", ct, "0"), ("m2", ct, "0")]  # welford


def _results(a: Accumulate) -> list[tuple[str, str]]:
    """(part, C type) of the combined results."""
    ct = VALUE[a.acc_dtype]
    if a.combine in ("argmax", "argmin"):
        return [("value", ct), ("index", "int64_t")]
    if a.combine == "welford":
        return [("cnt", ct), ("mean", ct), ("m2", ct)]
    return [("value", ct)]


def _suffix(a: Accumulate, part: str) -> str:
    """Array suffix that holds result `part` (lane and partial arrays share suffixes)."""
    if a.combine in ("argmax", "argmin"):
        return "v" if part == "value" else "i"
    return "" if part == "value" else part


def _declare_lanes(
    accs: Sequence[Accumulate], lines: list[str], indent: str, lanes: int = LANES
) -> None:
    for a in accs:
        fields = _lane_fields(a)
        for suffix, t, _ in fields:
            lines.append(f"{indent}{t} {a.name}_L{suffix}[{lanes}];")
        body = " ".join(f"{a.name}_L{s}[l] = {v};" for s, _, v in fields)
        lines.append(f"{indent}for (int l = 0; l < {lanes}; l++) {{ {body} }}")
        if a.combine == "welford":
            t = VALUE[a.acc_dtype]
            lines.append(f"{indent}{t} {a.name}_n = 0;  /* elements in each lane so far */")
            lines.append(f"{indent}{t} {a.name}_tmean = 0, {a.name}_tm2 = 0, {a.name}_tn = 0;")


def _update(a: Accumulate, v: str, lane: str, pos: str, indent: str, tail: bool) -> list[str]:
    n = f"{a.name}_L"
    t = VALUE[a.acc_dtype]
    if a.combine in ("sum", "prod", "any", "all"):
        op = {"sum": "+", "prod": "*", "any": "|", "all": "&"}[a.combine]
        return [f"{indent}{n}[{lane}] {op}= {v};"]
    if a.combine in ("max", "min"):
        if a.acc_dtype.is_floating_point:
            return [f"{indent}{n}[{lane}] = op_{a.combine}_{t}({n}[{lane}], {v});"]
        cmp = "<" if a.combine == "max" else ">"
        return [f"{indent}{n}[{lane}] = ({n}[{lane}] {cmp} {v}) ? {v} : {n}[{lane}];"]
    if a.combine in ("argmax", "argmin"):
        f = "op_take_max" if a.combine == "argmax" else "op_take_min"
        return [
            f"{indent}{{ const bool tk = {f}_{t}({v}, {pos}, {n}v[{lane}], {n}i[{lane}]);",
            f"{indent}  {n}v[{lane}] = tk ? {v} : {n}v[{lane}];",
            f"{indent}  {n}i[{lane}] = tk ? (int64_t)({pos}) : {n}i[{lane}]; }}",
        ]
    m = a.name
    if tail:  # welford, one element at a time
        return [
            f"{indent}{{ {m}_tn += 1; const {t} d = {v} - {m}_tmean;",
            f"{indent}  {m}_tmean += d / {m}_tn; {m}_tm2 += d * ({v} - {m}_tmean); }}",
        ]
    return [  # welford, every lane has seen NAME_n elements
        f"{indent}{{ const {t} d = {v} - {n}mean[{lane}];",
        f"{indent}  {n}mean[{lane}] += d * {m}_inv;",
        f"{indent}  {n}m2[{lane}] += d * ({v} - {n}mean[{lane}]); }}",
    ]


def _merge_step(a: Accumulate, src: str, idx: str) -> str:
    """Fold element `idx` of the arrays named `src`+suffix into the NAME_ results."""
    n, t = a.name, VALUE[a.acc_dtype]
    if a.combine in ("sum", "prod", "any", "all"):
        op = {"sum": "+", "prod": "*", "any": "|", "all": "&"}[a.combine]
        return f"{n}_value = {n}_value {op} {src}[{idx}];"
    if a.combine in ("max", "min"):
        if a.acc_dtype.is_floating_point:
            return f"{n}_value = op_{a.combine}_{t}({n}_value, {src}[{idx}]);"
        cmp = "<" if a.combine == "max" else ">"
        return f"{n}_value = ({n}_value {cmp} {src}[{idx}]) ? {src}[{idx}] : {n}_value;"
    if a.combine in ("argmax", "argmin"):
        f = "op_take_max" if a.combine == "argmax" else "op_take_min"
        return (
            f"if ({f}_{t}({src}v[{idx}], {src}i[{idx}], {n}_value, {n}_index)) "
            f"{{ {n}_value = {src}v[{idx}]; {n}_index = {src}i[{idx}]; }}"
        )
    return (
        f"op_welford_merge_{t}(&{n}_cnt, &{n}_mean, &{n}_m2, {src}cnt[{idx}], "
        f"{src}mean[{idx}], {src}m2[{idx}]);"
    )


def _combine_lanes(
    a: Accumulate, lines: list[str], indent: str, clause: bool = False, lanes: int = LANES
) -> None:
    if clause:
        return  # the pass's reduction clause already combined it into NAME_value
    n = a.name
    if a.combine == "welford":
        t = VALUE[a.acc_dtype]
        lines.append(f"{indent}{t} {n}_cnt = {n}_tn, {n}_mean = {n}_tmean, {n}_m2 = {n}_tm2;")
        lines.append(f"{indent}{t} {n}_Lcnt[{lanes}];")
        lines.append(f"{indent}for (int l = 0; l < {lanes}; l++) {n}_Lcnt[l] = {n}_n;")
        lines.append(f"{indent}for (int l = 0; l < {lanes}; l++) {_merge_step(a, n + '_L', 'l')}")
        return
    init = _lane_fields(a)
    decl = ", ".join(
        f"{n}_{part} = {init[0][2] if part == 'value' else 'INT64_MAX'}" for part, _ in _results(a)
    )
    types = {t for _, t in _results(a)}
    if len(types) == 1:
        lines.append(f"{indent}{types.pop()} {decl};")
    else:
        for (part, t), text in zip(_results(a), decl.split(", ")):
            lines.append(f"{indent}{t} {text};")
            del part
    lines.append(f"{indent}for (int l = 0; l < {lanes}; l++) {_merge_step(a, n + '_L', 'l')}")


# Combines OpenMP reduces itself: the compiler then picks the vector width. Welford and
# argmax/argmin need their own lanes (explicit arrays, see _pass_body).
OMP_REDUCTION = {"sum": "+", "prod": "*", "max": "max", "min": "min", "any": "|", "all": "&"}


def _simple(accs: Sequence[Accumulate]) -> bool:
    """Can OpenMP's reduction clauses do this pass (two-pass variances included)?"""
    return all(
        a.combine in OMP_REDUCTION or (a.combine == "welford" and a.algorithm == "two_pass")
        for a in accs
    )


def _pass_body(
    em: Emitter,
    p: Pass,
    inner: Sequence[Var],
    lines: list[str],
    indent: str,
    split: bool,
    number: int = 0,
) -> None:
    """Loops over the inner domain of one pass; the last inner variable is the vector
    loop. In the split schedule the first inner variable runs over this thread's [lo, hi)."""
    accs = p.accumulates
    if accs and _simple(accs):
        _reduction_clause_pass(em, p, inner, lines, indent, split)
        return
    lanes = lanes_for(accs)
    _declare_lanes(accs, lines, indent, lanes)
    # Values that read no memory (reduced results, constants) are computed once per row.
    invariant = _invariant([*(a.value for a in accs), *(s.value for s in p.stores)], inner)
    em.emit(invariant, lines, indent)
    ind = indent
    for i, v in enumerate(inner[:-1]):
        lo, hi = ("lo", "hi") if split and i == 0 else ("0", str(v.extent))
        lines.append(f"{ind}for (int64_t {v.name} = {lo}; {v.name} < {hi}; {v.name}++) {{")
        ind += "  "
    last = inner[-1]
    start, stop = ("lo", "hi") if split and len(inner) == 1 else ("0", str(last.extent))
    if not accs:
        lines.append(f"{ind}#pragma omp simd")
        lines.append(
            f"{ind}for (int64_t {last.name} = {start}; {last.name} < {stop}; {last.name}++) {{"
        )
        em.scopes.append({})
        _stores(em, p.stores, lines, ind + "  ")
        em.scopes.pop()
        lines.append(f"{ind}}}")
    else:
        b = f"{last.name}_b{number}"
        lines.append(f"{ind}int64_t {b} = {start};")
        lines.append(f"{ind}for (; {b} + {lanes} <= {stop}; {b} += {lanes}) {{")
        for a in accs:
            if a.combine == "welford":
                t = VALUE[a.acc_dtype]
                lines.append(f"{ind}  {a.name}_n += 1; const {t} {a.name}_inv = 1 / {a.name}_n;")
        lines.append(f"{ind}  #pragma omp simd")
        lines.append(f"{ind}  for (int l = 0; l < {lanes}; l++) {{")
        lines.append(f"{ind}    const int64_t {last.name} = {b} + l;")
        em.scopes.append({})
        _accumulate(em, p, lines, ind + "    ", "l", tail=False)
        em.scopes.pop()
        lines.append(f"{ind}  }}")
        lines.append(f"{ind}}}")
        lines.append(
            f"{ind}for (int64_t {last.name} = {b}; {last.name} < {stop}; {last.name}++) {{"
        )
        em.scopes.append({})
        _accumulate(em, p, lines, ind + "  ", "0", tail=True)
        em.scopes.pop()
        lines.append(f"{ind}}}")
    for _ in inner[:-1]:
        ind = ind[:-2]
        lines.append(f"{ind}}}")


def _reduction_clause_pass(
    em: Emitter, p: Pass, inner: Sequence[Var], lines: list[str], indent: str, split: bool
) -> None:
    """A pass whose reductions OpenMP combines: `#pragma omp simd reduction(...)` over
    the whole row. Float max/min also OR a NaN flag (OpenMP's max drops NaN). A two-pass
    variance sums the row, then the squared deviations from its mean, in a second loop."""
    clauses = []
    welford = [a for a in p.accumulates if a.combine == "welford"]
    for a in p.accumulates:
        t = VALUE[a.acc_dtype]
        if a.combine == "welford":
            lines.append(f"{indent}{t} {a.name}_sum = 0, {a.name}_m2 = 0;")
            clauses.append(f"reduction(+:{a.name}_sum)")
            continue
        init = _lane_fields(a)[0][2]
        lines.append(f"{indent}{t} {a.name}_value = {init};")
        clauses.append(f"reduction({OMP_REDUCTION[a.combine]}:{a.name}_value)")
        if a.combine in ("max", "min") and a.acc_dtype.is_floating_point:
            lines.append(f"{indent}int {a.name}_nan = 0;")
            clauses.append(f"reduction(|:{a.name}_nan)")
    invariant = _invariant([*(a.value for a in p.accumulates), *(s.value for s in p.stores)], inner)
    em.emit(invariant, lines, indent)

    def loop(clause: str, body_fn: Any) -> None:
        ind = indent
        for i, v in enumerate(inner[:-1]):
            lo, hi = ("lo", "hi") if split and i == 0 else ("0", str(v.extent))
            lines.append(f"{ind}for (int64_t {v.name} = {lo}; {v.name} < {hi}; {v.name}++) {{")
            ind += "  "
        last = inner[-1]
        start, stop = ("lo", "hi") if split and len(inner) == 1 else ("0", str(last.extent))
        r = last.name
        lines.append(f"{ind}#pragma omp simd {clause}")
        lines.append(f"{ind}for (int64_t {r} = {start}; {r} < {stop}; {r}++) {{")
        em.scopes.append({})
        body_fn(ind + "  ")
        em.scopes.pop()
        lines.append(f"{ind}}}")
        for _ in inner[:-1]:
            ind = ind[:-2]
            lines.append(f"{ind}}}")

    def first(body: str) -> None:
        em.emit([a.value for a in p.accumulates], lines, body)
        for a in p.accumulates:
            val = em.ref(a.value)
            if a.combine == "welford":
                lines.append(f"{body}{a.name}_sum += {val};")
                continue
            n = f"{a.name}_value"
            if a.combine in ("max", "min"):
                cmp = ">" if a.combine == "max" else "<"
                if a.acc_dtype.is_floating_point:
                    lines.append(f"{body}{a.name}_nan |= ({val} != {val});")
                lines.append(f"{body}{n} = ({n} {cmp} {val}) ? {n} : {val};")
            else:
                lines.append(f"{body}{n} {OMP_REDUCTION[a.combine]}= {val};")
        if not welford:
            _stores(em, p.stores, lines, body)

    def second(body: str) -> None:
        em.emit([a.value for a in welford], lines, body)
        for a in welford:
            t = VALUE[a.acc_dtype]
            lines.append(f"{body}{{ const {t} d = {em.ref(a.value)} - {a.name}_mean;")
            lines.append(f"{body}  {a.name}_m2 += d * d; }}")
        _stores(em, p.stores, lines, body)

    loop(" ".join(clauses), first)
    count = 1
    for v in inner:
        count *= v.extent
    for a in p.accumulates:
        t = VALUE[a.acc_dtype]
        if a.combine in ("max", "min") and a.acc_dtype.is_floating_point:
            lines.append(f"{indent}if ({a.name}_nan) {a.name}_value = ({t})NAN;")
        if a.combine == "welford":
            lines.append(
                f"{indent}const {t} {a.name}_cnt = {count}, {a.name}_mean = {a.name}_sum / {count};"
            )
    if welford:
        loop(" ".join(f"reduction(+:{a.name}_m2)" for a in welford), second)


def _accumulate(em: Emitter, p: Pass, lines: list[str], ind: str, lane: str, tail: bool) -> None:
    em.emit([a.value for a in p.accumulates], lines, ind)
    for a in p.accumulates:
        pos = index(a.position) if a.position is not None else "0"
        lines.extend(_update(a, em.ref(a.value), lane, pos, ind, tail))
    _stores(em, p.stores, lines, ind)


def _vars(e: Expr) -> set[str]:
    """Loop variables an expression depends on (through its loads and positions)."""
    out: set[str] = set()
    for s in walk([e]):
        if s.op == "load":
            out |= {v.name for v in s.value[1].variables()}
        elif s.op == "index":
            out |= {v.name for v in s.value.variables()}
    return out


def _invariant(roots: Sequence[Expr], loops: Sequence[Var]) -> list[Expr]:
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
            varying = bool(_vars(e) & names)
        memo[e] = varying
        if not varying:
            out.append(e)
    return out


def _publish(em: Emitter, a: Accumulate) -> None:
    """Bind the combined results to the Expr 'acc' leaves that later values read."""
    for part, _ in _results(a):
        if part == "cnt":
            continue
        dtype = torch.int64 if part == "index" else a.acc_dtype
        if a.combine in ("argmax", "argmin") and part == "value":
            dtype = a.value.dtype
        em.scopes[0][Expr("acc", (), dtype, (a.name, part))] = f"{a.name}_{part}"


def _rows(k: Kernel, lines: list[str]) -> None:
    """Each thread reduces whole rows: parallel over the outer (kept) index."""
    total = k.outer_size * k.inner_size
    indent = "  "
    if k.outer:
        lines.append(
            f"  #pragma omp parallel for collapse({len(k.outer)}) num_threads(nthreads) "
            f"schedule(static) if({total} >= {PARALLEL_MIN})"
        )
    for v in k.outer:
        lines.append(_loop(v, indent))
        indent += "  "
    em = Emitter([{}], [0])
    em.scopes.append({})
    for number, p in enumerate(k.passes):
        _pass_body(em, p, k.inner, lines, indent, split=False, number=number)
        for a in p.accumulates:
            _combine_lanes(
                a, lines, indent, clause=_simple(p.accumulates), lanes=lanes_for(p.accumulates)
            )
            _publish(em, a)
        _stores(em, p.after, lines, indent)
    for _ in k.outer:
        indent = indent[:-2]
        lines.append(f"{indent}}}")


def _split(k: Kernel, lines: list[str]) -> None:
    """Few, long rows: all threads share each row and combine partial results."""
    accs = [a for p in k.passes for a in p.accumulates]
    for a in accs:  # partials live outside the parallel region: shared by the threads
        for part, t in _results(a):
            lines.append(f"  {t} {a.name}_P{_suffix(a, part)}[nthreads > 0 ? nthreads : 1];")
    lines.append("  #pragma omp parallel num_threads(nthreads)")
    lines.append("  {")
    lines.append("    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();")
    first = k.inner[0]
    align = max(lanes_for(p.accumulates) for p in k.passes) if len(k.inner) == 1 else 1
    ext = first.extent
    lines.append(
        f"    const int64_t chunk = (({ext} + nt - 1) / nt + {align - 1}) / {align} * {align};"
    )
    lines.append(f"    const int64_t lo = tid * chunk < {ext} ? tid * chunk : {ext};")
    lines.append(f"    const int64_t hi = lo + chunk < {ext} ? lo + chunk : {ext};")
    indent = "    "
    for v in k.outer:
        lines.append(_loop(v, indent))
        indent += "  "
    em = Emitter([{}], [0])
    em.scopes.append({})
    for number, p in enumerate(k.passes):
        _pass_body(em, p, k.inner, lines, indent, split=True, number=number)
        for a in p.accumulates:
            _combine_lanes(
                a, lines, indent, clause=_simple(p.accumulates), lanes=lanes_for(p.accumulates)
            )
            for part, _ in _results(a):
                lines.append(f"{indent}{a.name}_P{_suffix(a, part)}[tid] = {a.name}_{part};")
        if p.accumulates:
            lines.append(f"{indent}#pragma omp barrier")
        for a in p.accumulates:
            reset = "; ".join(
                f"{a.name}_{part} = {_reset_value(a, part)}" for part, _ in _results(a)
            )
            lines.append(f"{indent}{reset};")
            lines.append(
                f"{indent}for (int q = 0; q < nt; q++) {_merge_step(a, a.name + '_P', 'q')}"
            )
            _publish(em, a)
        if p.accumulates:
            # Nobody may overwrite the partials (next row or pass) before all have read them.
            lines.append(f"{indent}#pragma omp barrier")
        if p.after:
            lines.append(f"{indent}if (tid == 0) {{")
            em.scopes.append({})
            _stores(em, p.after, lines, indent + "  ")
            em.scopes.pop()
            lines.append(f"{indent}}}")
    for _ in k.outer:
        indent = indent[:-2]
        lines.append(f"{indent}}}")
    lines.append("  }")


def _reset_value(a: Accumulate, part: str) -> str:
    if part in ("cnt", "mean", "m2"):
        return "0"
    if part == "index":
        return "INT64_MAX"
    return _lane_fields(a)[0][2]


def _columns(k: Kernel, lines: list[str]) -> None:
    """Lanes are neighbouring outputs: the kept dimension memory walks contiguously (the
    last outer variable) is cut into blocks of COLUMN_LANES; every lane reduces its own column."""
    *rest, vec = k.outer
    blocks = (vec.extent + COLUMN_LANES - 1) // COLUMN_LANES
    total = k.outer_size * k.inner_size
    lines.append(
        f"  #pragma omp parallel for collapse({len(rest) + 1}) num_threads(nthreads) "
        f"schedule(static) if({total} >= {PARALLEL_MIN})"
    )
    indent = "  "
    for v in rest:
        lines.append(_loop(v, indent))
        indent += "  "
    blk = f"{vec.name}_blk"
    lines.append(f"{indent}for (int64_t {blk} = 0; {blk} < {blocks}; {blk}++) {{")
    indent += "  "
    left = f"{vec.extent} - {blk} * {COLUMN_LANES}"
    lines.append(f"{indent}const int64_t nl = {left} < {COLUMN_LANES} ? {left} : {COLUMN_LANES};")
    lane = f"const int64_t {vec.name} = {vec.name}_blk * {COLUMN_LANES} + l;"
    em = Emitter([{}], [0])
    for p in k.passes:
        _declare_lanes(p.accumulates, lines, indent, COLUMN_LANES)
        ind = indent
        for v in k.inner:
            lines.append(_loop(v, ind))
            ind += "  "
        for a in p.accumulates:
            if a.combine == "welford":
                t = VALUE[a.acc_dtype]
                lines.append(f"{ind}{a.name}_n += 1; const {t} {a.name}_inv = 1 / {a.name}_n;")
        lines.append(f"{ind}#pragma omp simd")
        lines.append(f"{ind}for (int l = 0; l < nl; l++) {{")
        lines.append(f"{ind}  {lane}")
        em.scopes.append({})
        _accumulate(em, p, lines, ind + "  ", "l", tail=False)
        em.scopes.pop()
        lines.append(f"{ind}}}")
        for _ in k.inner:
            ind = ind[:-2]
            lines.append(f"{ind}}}")
        for a in p.accumulates:
            for part, suffix in _lane_parts(a):
                dtype = torch.int64 if part == "index" else a.acc_dtype
                if a.combine in ("argmax", "argmin") and part == "value":
                    dtype = a.value.dtype
                em.scopes[0][Expr("acc", (), dtype, (a.name, part))] = f"{a.name}_L{suffix}[l]"
        if p.after:
            lines.append(f"{indent}#pragma omp simd")
            lines.append(f"{indent}for (int l = 0; l < nl; l++) {{")
            lines.append(f"{indent}  {lane}")
            em.scopes.append({})
            _stores(em, p.after, lines, indent + "  ")
            em.scopes.pop()
            lines.append(f"{indent}}}")
    lines.append(f"{indent[:-2]}}}")
    indent = indent[:-2]
    for _ in rest:
        indent = indent[:-2]
        lines.append(f"{indent}}}")


def _lane_parts(a: Accumulate) -> list[tuple[str, str]]:
    """(result part, lane array suffix): in the columns schedule each lane's array slot is
    already that column's result."""
    if a.combine in ("argmax", "argmin"):
        return [("value", "v"), ("index", "i")]
    if a.combine == "welford":
        return [("mean", "mean"), ("m2", "m2")]
    return [("value", "")]
