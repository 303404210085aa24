"""Kernels rendered as Triton: one @triton.jit function and its launcher per kernel.

The same backend-neutral `Kernel` the C renderer reads (lower/kernel.py). A pointwise
kernel runs one program per XBLOCK elements of its flattened outer domain. A kernel with
inner (reduced) variables runs one program per XBLOCK rows: each pass walks the row in
RBLOCK-wide chunks, folding values into [XBLOCK, RBLOCK] accumulator lanes, and the lanes
are combined once per pass (`tl.reduce`); the reduced results are [XBLOCK, 1] tensors that
broadcast into later passes and into the stores made after the pass. The C schedules
(rows / split / columns, pieces, unswitched cases, transposed tiles) are CPU decisions: a
Triton program already reads a tile of rows, so the whole kernel is rendered as one.

Formatting only: formulas come from `scalar.PRIMS` (the `triton` column); what a renderer
cannot express raises NotRenderable and the group runs with torch. The pieces of a row pass
(`Emitter`, `row_pass`, `lane_fields`, `initial`, `finish`, `emit_stores`, `outer_vars`,
`pow2`) are public: split.py renders a row cut across programs with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...ir.combine import Family, Identity
from ...ir.index import Ix, Var
from ...ir.scalar import PRIMS, Expr, format_float
from ...ir.size import symbolic_text
from ...lower.kernel import Accumulate, Kernel, Pass, Store
from ..common import IndexSyntax, Namer, index_text, traffic

# Block sizes as inductor's heuristics start them (not tuned: no GPU was available): 1024
# elements per pointwise program; a reduction program's [XBLOCK, RBLOCK] lane tile holds
# 1024 elements, 8 per thread of 4 warps, so that float64 accumulators stay in registers.
XBLOCK_POINTWISE = 1024
REDUCTION_TILE = 1024
RBLOCK_MAX = 1024
NUM_WARPS = 4

TL = {
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.int8: "tl.int8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
    torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}


class NotRenderable(Exception):
    """The kernel uses something this renderer has no Triton form for."""


# Helpers the formulas in scalar.PRIMS name (torch's semantics, as the C prelude has them).
PRELUDE = """
@triton.jit
def opfuse_floordiv(a, b):
    # a size expression's floor division (ir/size.py), b > 0: exact in C's and Python's
    # conventions alike, whichever the integer // and % follow
    r = ((a % b) + b) % b
    return (a - r) // b


@triton.jit
def opfuse_floormod(a, b):
    return ((a % b) + b) % b


@triton.jit
def op_max(a, b):
    # torch.maximum / relu / clamp: NaN in either operand gives NaN
    return tl.where((a < b) | (b != b), b, a)


@triton.jit
def op_min(a, b):
    return tl.where((b < a) | (b != b), b, a)


@triton.jit
def op_remainder(a, b):
    # Python-style modulo: the result takes the divisor's sign
    m = libdevice.fmod(a, b)
    return tl.where((m != 0) & ((b < 0) != (m < 0)), m + b, m)


@triton.jit
def op_div_floor(a, b):
    # ATen's div_floor_floating
    m = libdevice.fmod(a, b)
    d = (a - m) / b
    d = tl.where((m != 0) & ((b < 0) != (m < 0)), d - 1, d)
    fl = libdevice.floor(d)
    fl = tl.where(d - fl > 0.5, fl + 1, fl)
    zero = libdevice.copysign(d * 0, a / b)
    return tl.where(b == 0, a / b, tl.where(d != 0, fl, zero))


@triton.jit
def op_div_floor_int(a, b):
    q = a // b
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)


@triton.jit
def op_fmod_int(a, b):
    return a % b


@triton.jit
def op_remainder_int(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def op_shr(a, b):
    # torch's >>: arithmetic on signed types; past the width, the sign fills
    bits: tl.constexpr = a.dtype.primitive_bitwidth
    big = (b < 0) | (b >= bits)
    fill = tl.where(a < 0, -1, 0).to(a.dtype)
    return tl.where(big, fill, a >> tl.where(big, 0, b).to(a.dtype))


@triton.jit
def op_shl(a, b):
    bits: tl.constexpr = a.dtype.primitive_bitwidth
    big = (b < 0) | (b >= bits)
    return tl.where(big, 0, a << tl.where(big, 0, b).to(a.dtype)).to(a.dtype)


@triton.jit
def op_pow_int(a, b):
    # torch's integer pow: wraps like repeated multiplication; a negative exponent gives
    # 1 for a == 1, +-1 for a == -1, 0 otherwise
    r = a * 0 + 1
    x = a
    e = tl.where(b < 0, 0, b)
    for _ in tl.static_range(63):
        r = tl.where((e & 1) != 0, r * x, r)
        x = x * x
        e = e >> 1
    neg = tl.where(a == 1, 1, tl.where(a == -1, tl.where((b % 2) == 0, 1, -1), 0))
    return tl.where(b < 0, neg.to(r.dtype), r)


@triton.jit
def op_mix64(seed, counter):
    # rewrite/random.py's SplitMix64 of (seed, counter), as the C prelude computes it
    z = seed.to(tl.uint64, bitcast=True) + (counter.to(tl.uint64, bitcast=True) + 1) * (
        0x9E3779B97F4A7C15
    )
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return (z ^ (z >> 31)).to(tl.int64, bitcast=True)


@triton.jit
def combine_sum(a, b):
    return a + b


@triton.jit
def combine_prod(a, b):
    return a * b


@triton.jit
def combine_or(a, b):
    return a | b


@triton.jit
def combine_and(a, b):
    return a & b


@triton.jit
def take_max(v, i, bv, bi):
    # argmax: does (v, i) replace (bv, bi)? NaN is the extreme value; ties go to the
    # lower index (torch's first occurrence)
    return tl.where(v != v, (bv == bv) | (i < bi),
                    tl.where(bv != bv, False, (v > bv) | ((v == bv) & (i < bi))))


@triton.jit
def take_min(v, i, bv, bi):
    return tl.where(v != v, (bv == bv) | (i < bi),
                    tl.where(bv != bv, False, (v < bv) | ((v == bv) & (i < bi))))


@triton.jit
def combine_argmax(bv, bi, v, i):
    t = take_max(v, i, bv, bi)
    return tl.where(t, v, bv), tl.where(t, i, bi)


@triton.jit
def combine_argmin(bv, bi, v, i):
    t = take_min(v, i, bv, bi)
    return tl.where(t, v, bv), tl.where(t, i, bi)


@triton.jit
def combine_welford(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    # Chan et al.; lanes that saw nothing (n == 0) merge as no-ops
    n = n_a + n_b
    w = tl.where(n == 0, 0.0, n_b / tl.where(n == 0, 1.0, n))
    d = mean_b - mean_a
    return mean_a + d * w, m2_a + m2_b + d * d * n_a * w, n
"""


def literal(value: object, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "True" if value else "False"
    if dtype.is_floating_point:
        f = float(value)  # type: ignore[arg-type]
        if f != f:
            return "float('nan')"
        if f in (float("inf"), float("-inf")):
            return "float('inf')" if f > 0 else "float('-inf')"
        return format_float(f)
    return str(int(value))  # type: ignore[call-overload]


_INDEX = IndexSyntax(
    floordiv="(({x}) // {d})",
    mod="(({x}) % {d})",
    clamp="tl.minimum(tl.maximum({x}, 0), {hi})",
    scaled="{c} * {a}",
)


def index(ix: Ix) -> str:
    return index_text(ix, _INDEX)


class Emitter(Namer):
    """Linearises Expr DAGs into Triton assignments, naming each value once per scope.
    `zero` is an int64 tensor of the scope's shape: added to an index it gives every
    position (and every scalar load) that shape."""

    def __init__(self, counter: list[int]) -> None:
        super().__init__([{}], counter)
        self.mask = "xmask"
        self.zero = "xzero"

    def assign(self, name: str, e: Expr, text: str) -> str:
        return f"{name} = {text}"

    def text(self, e: Expr) -> str:
        if e.op == "const":
            # shaped like the scope's positions: the interpreter mistypes comparisons of
            # 0-d tensors
            return f"tl.full({self.zero}.shape, {literal(e.value, e.dtype)}, {TL[e.dtype]})"
        if e.op == "load":
            buf, ix = e.value
            return f"tl.load({buf} + ({self.zero} + {index(ix)}), mask={self.mask}, other=0)"
        if e.op == "acc":
            name, part = e.value
            return f"{name}_{part}"
        if e.op == "index":
            return f"({self.zero} + {index(e.value)})"
        if e.op == "cast":
            src = e.args[0].dtype
            x = self.ref(e.args[0])
            if e.dtype == torch.bool:
                return f"({x} != 0)"
            if src == torch.bool:
                return f"{x}.to(tl.int8).to({TL[e.dtype]})"
            return f"{x}.to({TL[e.dtype]})"
        prim = PRIMS[e.op]
        operand = e.args[0].dtype if e.op != "where" else e.args[1].dtype
        integer = not operand.is_floating_point
        tmpl = prim.triton_int if integer and prim.triton_int is not None else prim.triton
        if not tmpl:
            raise NotRenderable(f"{e.op} has no Triton formula")
        if e.op == "not" and operand == torch.bool:
            tmpl = "({0} == 0)"
        return tmpl.format(*(self.ref(a) for a in e.args))


def render_kernel(name: str, k: Kernel, checks: bool = True) -> str:
    """The Triton source of kernel `k`: `{name}_kernel` (jit) and `{name}(args, nthreads)`,
    the launcher the runtime calls with the kernel's buffers in order. Without `checks`
    the kernel leaves out `k.checks` (integer division by zero): torch's GPU kernels do not
    check either, and reading the flag would make every launch wait for the GPU.

    The jit function prints a graph's symbolic sizes (ir/size.py) as parameters, which the
    launcher passes as this size's values: every size of the graph renders the same jit
    function, which Triton compiles once per block shape and integer specialisation."""
    from . import split as _split  # it renders with this module's pieces

    outer = k.outer_size
    counter = [0]
    body: list[str] = []
    tests = k.checks if checks else ()
    with symbolic_text() as seen:
        if not k.inner:
            xblock, rblock = min(XBLOCK_POINTWISE, pow2(outer)), 1
            _pointwise(k, tests, body, counter)
        elif (pieces := _split.pieces(k)) > 1:
            return _split.render(name, k, pieces, tests, seen)
        else:
            rblock = min(RBLOCK_MAX, pow2(k.inner_size))
            xblock = max(1, min(pow2(outer), REDUCTION_TILE // rblock))
            _rows(k, tests, body, counter)
    symbols = sorted(seen)
    lines = [f"# {name}: {', '.join(k.ops)}"]
    lines.append(f"# {traffic(k)}")
    # a kernel dividing integers sets err[0] where a divisor is 0 (torch raises then)
    params = ", ".join([b.name for b in k.buffers] + symbols + (["err"] if tests else []))
    lines.append("@triton.jit")
    lines.append(f"def {name}_kernel({params}, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):")
    lines += body
    grid = -(-outer // xblock)
    lines.append("")
    lines.append("")
    lines.append(f"def {name}(args, nthreads=0):")
    err = ""
    if tests:
        lines.append("    err = torch.zeros(1, dtype=torch.int32, device=args[0].device)")
        err = ", err"
    values = "".join(f", {seen[s]}" for s in symbols)
    lines.append(
        f"    {name}_kernel[({int(grid)},)](*args{values}{err}, XBLOCK={xblock}, "
        f"RBLOCK={rblock}, num_warps={NUM_WARPS})"
    )
    lines.append("    return int(err.item())" if tests else "    return 0")
    return "\n".join(lines) + "\n"


def render_module(kernels: Sequence[str]) -> str:
    """One importable module: the helpers, then the rendered kernels."""
    head = [
        "import torch",
        "import triton",
        "import triton.language as tl",
        "from opfuse.backends.triton.libdevice import for_mode, interpreting",
        "",
        "libdevice = for_mode(interpreting())",
        PRELUDE,
    ]
    return "\n".join(head) + "\n\n" + "\n\n".join(kernels)


def pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def outer_vars(k: Kernel, lines: list[str], indent: str, shape: str) -> None:
    """xl: the flat outer positions this program owns; the outer variables from it (the
    last one varies fastest, as the C loop nest runs them)."""
    lines.append(
        f"{indent}xl = tl.program_id(0).to(tl.int64) * XBLOCK + tl.arange(0, XBLOCK){shape}"
    )
    lines.append(f"{indent}xmask = xl < {k.outer_size}")
    lines.append(f"{indent}xzero = xl * 0")
    _delinearize(k.outer, "xl", lines, indent)


def _delinearize(vs: Sequence[Var], flat: str, lines: list[str], indent: str) -> None:
    stride = 1
    for v in reversed(vs):
        q = flat if stride == 1 else f"({flat} // {stride})"
        lines.append(
            f"{indent}{v.name} = {q} % {v.extent}" if v is not vs[0] else f"{indent}{v.name} = {q}"
        )
        stride *= v.extent


def emit_stores(em: Emitter, stores: Sequence[Store], lines: list[str], indent: str) -> None:
    em.emit([s.value for s in stores], lines, indent)
    for s in stores:
        mask = em.mask
        if s.guard is not None:
            mask = f"{mask} & (({em.zero} + {index(s.guard)}) == 0)"
        lines.append(
            f"{indent}tl.store({s.buffer} + ({em.zero} + {index(s.index)}), "
            f"{em.ref(s.value)}, mask={mask})"
        )


def _checks(em: Emitter, checks: Sequence[Expr], lines: list[str], indent: str) -> None:
    em.emit(checks, lines, indent)
    for c in checks:
        lines.append(f"{indent}tl.store(err + {em.zero} * 0, 1, mask={em.mask} & {em.ref(c)})")


def _pointwise(k: Kernel, checks: Sequence[Expr], lines: list[str], counter: list[int]) -> None:
    ind = "    "
    outer_vars(k, lines, ind, "")
    em = Emitter(counter)
    _checks(em, checks, lines, ind)
    for p in k.passes:
        emit_stores(em, p.stores, lines, ind)
        emit_stores(em, p.after, lines, ind)


_IDENTITY = {
    Identity.ZERO: "0",
    Identity.ONE: "1",
    Identity.LOWEST: "float('-inf')",
    Identity.HIGHEST: "float('inf')",
}


def lane_fields(a: Accumulate) -> tuple[tuple[str, str], ...]:
    """(field, initial value) of each lane tensor."""
    r = a.row
    if r.family is Family.WELFORD:
        return (("mean", "0"), ("m2", "0"), ("n", "0"))
    init = _IDENTITY[r.identity]
    if r.family is Family.ARGSELECT:
        return (("value", init), ("index", "9223372036854775807"))
    return (("value", init),)


_INT_EXTREMES = {
    torch.int8: (-(2**7), 2**7 - 1),
    torch.int16: (-(2**15), 2**15 - 1),
    torch.int32: (-(2**31), 2**31 - 1),
    torch.int64: (-(2**63), 2**63 - 1),
    torch.uint8: (0, 255),
    torch.bool: (0, 1),
}


def initial(a: Accumulate, field: str, init: str) -> tuple[str, str]:
    """(initial value, Triton dtype) of one lane field."""
    t, r = a.acc_dtype, a.row
    if field == "index":
        return init, "tl.int64"
    if r.logical:
        return init, "tl.int8"
    if r.family in (Family.SELECT, Family.ARGSELECT) and not t.is_floating_point:
        lo, hi = _INT_EXTREMES[t]
        return str(lo if r.extreme_lo else hi), TL[t]
    return init, TL[t]


def _rows(k: Kernel, checks: Sequence[Expr], lines: list[str], counter: list[int]) -> None:
    ind = "    "
    outer_vars(k, lines, ind, "[:, None]")
    em = Emitter(counter)
    stored = False
    for i, p in enumerate(k.passes):
        if stored:
            # A pass may read back what an earlier one stored (softmax's exp values): on a
            # GPU the element may have been stored by another thread of the program, and
            # only a barrier makes that store visible (the interpreter runs in order).
            lines.append(f"{ind}tl.debug_barrier()")
        row_pass(k, p, em, lines, ind, checks if i == 0 else ())
        stored = stored or bool(p.stores)


def row_pass(
    k: Kernel,
    p: Pass,
    em: Emitter,
    lines: list[str],
    ind: str,
    checks: Sequence[Expr],
    span: tuple[str, str] | None = None,
) -> None:
    """One pass over the rows: its lanes, the loop over `span` (the whole row, or one
    program's piece of it: split.py), its stores; with the whole row, its results and the
    stores after it."""
    for a in p.accumulates:
        for f, init in lane_fields(a):
            v, t = initial(a, f, init)
            lines.append(f"{ind}{a.name}_l{f} = tl.full([XBLOCK, RBLOCK], {v}, {t})")
    lo, hi = span or ("0", f"{k.inner_size}")
    body = ind + "    "
    lines.append(f"{ind}for roff in range({lo}, {hi}, RBLOCK):")
    lines.append(f"{body}rl = (roff + tl.arange(0, RBLOCK)[None, :]).to(tl.int64)")
    lines.append(f"{body}rzero = xzero + rl * 0")
    lines.append(f"{body}rmask = xmask & (rl < {hi})")
    _delinearize(k.inner, "rl", lines, body)
    em.scopes.append({})
    em.mask, em.zero = "rmask", "rzero"
    _checks(em, checks, lines, body)
    em.emit([a.value for a in p.accumulates], lines, body)
    for a in p.accumulates:
        _fold(a, em, lines, body)
    emit_stores(em, p.stores, lines, body)
    em.scopes.pop()
    em.mask, em.zero = "xmask", "xzero"
    if span is not None:
        return
    for a in p.accumulates:
        finish(a, lines, ind)
    emit_stores(em, p.after, lines, ind)


def _fold(a: Accumulate, em: Emitter, lines: list[str], ind: str) -> None:
    v = em.ref(a.value)
    n = a.name
    t = TL[a.acc_dtype]
    r = a.row
    if r.family is Family.FOLD and r.logical:
        lines.append(
            f"{ind}{n}_lvalue = tl.where(rmask, {n}_lvalue {r.op} ({v} != 0).to(tl.int8), "
            f"{n}_lvalue)"
        )
    elif r.family is Family.FOLD:
        lines.append(
            f"{ind}{n}_lvalue = tl.where(rmask, {n}_lvalue {r.op} {v}.to({t}), {n}_lvalue)"
        )
    elif r.family is Family.SELECT:
        f = f"op_{r.op}"
        lines.append(f"{ind}{n}_lvalue = tl.where(rmask, {f}({n}_lvalue, {v}.to({t})), {n}_lvalue)")
    elif r.family is Family.ARGSELECT:
        assert a.position is not None
        take = f"take_{r.op}"
        lines.append(f"{ind}{n}_pos = rzero + {index(a.position)}")
        lines.append(
            f"{ind}{n}_take = rmask & {take}({v}.to({t}), {n}_pos, {n}_lvalue, {n}_lindex)"
        )
        lines.append(f"{ind}{n}_lvalue = tl.where({n}_take, {v}.to({t}), {n}_lvalue)")
        lines.append(f"{ind}{n}_lindex = tl.where({n}_take, {n}_pos, {n}_lindex)")
    else:  # welford: one more value per lane
        lines.append(f"{ind}{n}_x = {v}.to({t})")
        lines.append(f"{ind}{n}_nn = tl.where(rmask, {n}_ln + 1, {n}_ln)")
        lines.append(f"{ind}{n}_d = tl.where(rmask, {n}_x - {n}_lmean, 0)")
        lines.append(f"{ind}{n}_lmean = {n}_lmean + {n}_d / tl.where({n}_nn == 0, 1, {n}_nn)")
        lines.append(f"{ind}{n}_lm2 = {n}_lm2 + {n}_d * tl.where(rmask, {n}_x - {n}_lmean, 0)")
        lines.append(f"{ind}{n}_ln = {n}_nn")


def finish(a: Accumulate, lines: list[str], ind: str) -> None:
    n, r = a.name, a.row
    fn = r.triton_merge
    if r.family in (Family.FOLD, Family.SELECT):
        truth = " != 0" if r.logical else ""
        lines.append(f"{ind}{n}_value = tl.reduce({n}_lvalue, 1, {fn})[:, None]{truth}")
    elif r.family is Family.ARGSELECT:
        lines.append(f"{ind}{n}_value, {n}_index = tl.reduce(({n}_lvalue, {n}_lindex), 1, {fn})")
        lines.append(f"{ind}{n}_value = {n}_value[:, None]")
        lines.append(f"{ind}{n}_index = {n}_index[:, None]")
    else:
        lines.append(
            f"{ind}{n}_mean, {n}_m2, {n}_n = tl.reduce(({n}_lmean, {n}_lm2, {n}_ln), 1, {fn})"
        )
        lines.append(f"{ind}{n}_mean = {n}_mean[:, None]")
        lines.append(f"{ind}{n}_m2 = {n}_m2[:, None]")
