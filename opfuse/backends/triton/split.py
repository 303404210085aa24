"""A reduction over few, long rows, split across programs: on a GPU one program per row
(or per XBLOCK rows) leaves most of the chip idle (`x.sum()` over 8M elements: one program,
40x slower than torch on an H200). The row is cut into `pieces`; the first kernel runs
(rows, pieces) programs, each folding its piece into the usual lanes and storing each
accumulator's combined partial; the second runs one program per XBLOCK rows, loads the
rows' partials as its lanes, combines them with the same merge functions (`tl.reduce`)
and makes the stores after the reduction.

Only single-pass kernels split (a second pass would read the first's results in every
piece); formatting only, with render.py's pieces.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...ir.scalar import Expr
from ...lower.kernel import Kernel
from ..common import traffic
from . import render as r

# Programs a reduction should give the GPU at least (about two per SM of an H100/H200),
# and the row elements one program walks at least (its loop's fixed cost amortised).
MIN_PROGRAMS = 256
MIN_PIECE = 4096

_TORCH = {v: k for k, v in r.TL.items()}


def pieces(k: Kernel) -> int:
    """How many pieces each row is cut into (1: not split)."""
    if len(k.passes) != 1 or not k.passes[0].accumulates:
        return 1
    outer, inner = int(k.outer_size), int(k.inner_size)
    n = 1
    while outer * n < MIN_PROGRAMS and inner // (2 * n) >= MIN_PIECE:
        n *= 2
    return n


def render(name: str, k: Kernel, n: int, checks: Sequence[Expr], seen: dict[str, int]) -> str:
    """The two jit functions and their launcher (render_kernel's contract)."""
    p = k.passes[0]
    fields = [
        (f"ws_{a.name}_{f}", a, f, *r.initial(a, f, init))
        for a in p.accumulates
        for f, init in r.lane_fields(a)
    ]
    ws = [w for w, *_ in fields]
    counter = [0]
    first: list[str] = []
    ind = "    "
    r.outer_vars(k, first, ind, "[:, None]")
    first.append(f"{ind}rstart = tl.program_id(1).to(tl.int64) * CHUNK")
    first.append(f"{ind}rend = tl.minimum(rstart + CHUNK, {k.inner_size})")
    em = r.Emitter(counter)
    r.row_pass(k, p, em, first, ind, checks, span=("rstart", "rend"))
    for a in p.accumulates:
        lanes = [f"{a.name}_l{f}" for f, _ in r.lane_fields(a)]
        parts = [f"{a.name}_p{f}" for f, _ in r.lane_fields(a)]
        many = len(lanes) > 1
        first.append(
            f"{ind}{', '.join(parts)} = tl.reduce("
            f"{'(' + ', '.join(lanes) + ')' if many else lanes[0]}, 1, {a.row.triton_merge})"
        )
    for w, a, f, _, _ in fields:
        first.append(
            f"{ind}tl.store({w} + xl * {n} + tl.program_id(1), {a.name}_p{f}[:, None], mask=xmask)"
        )
    second: list[str] = []
    r.outer_vars(k, second, ind, "[:, None]")
    for w, a, f, init, t in fields:
        second.append(
            f"{ind}{a.name}_l{f} = tl.load({w} + xl * RBLOCK + tl.arange(0, RBLOCK)[None, :], "
            f"mask=xmask, other={init}).to({t})"
        )
    for a in p.accumulates:
        r.finish(a, second, ind)
    r.emit_stores(r.Emitter(counter), p.after, second, ind)

    symbols = sorted(seen)
    head = [b.name for b in k.buffers] + symbols
    err = ["err"] if checks else []
    piece = -(-int(k.inner_size) // n)
    rblock = min(r.RBLOCK_MAX, r.pow2(piece))
    chunk = -(-piece // rblock) * rblock  # whole RBLOCKs: each piece starts aligned
    outer = int(k.outer_size)
    x1 = max(1, min(r.pow2(outer), r.REDUCTION_TILE // rblock))
    x2 = max(1, min(r.pow2(outer), r.REDUCTION_TILE // n))
    lines = [f"# {name}: {', '.join(k.ops)}; each row in {n} pieces"]
    lines.append(f"# {traffic(k)}")
    lines.append("@triton.jit")
    lines.append(
        f"def {name}_kernel({', '.join([*head, 'CHUNK', *ws, *err])}, "
        "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):"
    )
    lines += first
    lines.append("")
    lines.append("")
    lines.append("@triton.jit")
    lines.append(
        f"def {name}_merge({', '.join([*head, *ws])}, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):"
    )
    lines += second
    lines.append("")
    lines.append("")
    lines.append(f"def {name}(args, nthreads=0):")
    lines.append("    dev = args[0].device")
    for w, _, _, _, t in fields:
        lines.append(f"    {w} = torch.empty({outer * n}, dtype={_torch_name(t)}, device=dev)")
    if checks:
        lines.append("    err = torch.zeros(1, dtype=torch.int32, device=dev)")
    values = "".join(f", {seen[s]}" for s in symbols)
    spaces = "".join(f", {w}" for w in ws)
    lines.append(
        f"    {name}_kernel[({-(-outer // x1)}, {n})](*args{values}, {chunk}{spaces}"
        f"{', err' if checks else ''}, XBLOCK={x1}, RBLOCK={rblock}, num_warps={r.NUM_WARPS})"
    )
    lines.append(
        f"    {name}_merge[({-(-outer // x2)},)](*args{values}{spaces}, XBLOCK={x2}, "
        f"RBLOCK={n}, num_warps={r.NUM_WARPS})"
    )
    lines.append("    return int(err.item())" if checks else "    return 0")
    return "\n".join(lines) + "\n"


def _torch_name(tl_type: str) -> str:
    return str(_TORCH[tl_type]) if tl_type in _TORCH else "torch.float32"
