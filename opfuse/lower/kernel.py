"""The backend-neutral kernel description a fused group lowers to.

A kernel iterates a domain split into `outer` loop variables (the kept dimensions, run in
parallel) and `inner` ones (the reduced dimensions; none for a pointwise kernel). Its work
is a sequence of passes over the inner domain:

    for each outer index:                      # parallel
        pass 0: accumulate reductions, store values that need no reduction
        finish pass-0 reductions; store reduced outputs that are now complete
        pass 1: accumulate reductions that read pass-0 results (softmax's sum after its max),
                store full-size outputs that read them (the normalised LayerNorm output)
        ...

Values are `scalar.Expr` DAGs whose leaves are loads (buffer, `Ix` offset), constants and
reduction results ("acc" leaves). Renderers turn this into C or Triton; they choose no
semantics, only syntax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..ir.combine import COMBINES, Combine, CombineRow
from ..ir.index import Ix, Var
from ..ir.scalar import Expr
from ..ir.size import is_size
from ..ir.strenum import StrEnum

PARALLEL_MIN = 1 << 15  # elements below which a kernel runs on one thread


@dataclass(frozen=True)
class Buffer:
    name: str  # identifier in the kernel: in0, out1, ...
    dtype: torch.dtype
    role: str  # "in" | "out"
    value: str  # the graph value it holds
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class Store:
    buffer: str
    index: Ix
    value: Expr
    guard: Ix | None = None  # store only where this is 0 (outputs smaller than the domain)


@dataclass(frozen=True)
class Accumulate:
    """One reduction: `value` is folded into accumulator `name` at every inner point.

    Results are read as Expr("acc", value=(name, part)), part one of the combine's
    `parts` (ir/combine.py).
    """

    name: str
    combine: Combine
    value: Expr
    acc_dtype: torch.dtype
    position: Ix | None = None  # argmax/argmin: row-major position within the reduction
    # welford only: "two_pass" reads a row twice (mean, then squared deviations): as
    # stable, and faster when the row stays in cache; "welford" reads it once.
    algorithm: str = "welford"
    # sum only: fold runs of `block` consecutive values in value.dtype, then add each run's
    # total into acc_dtype. float32 runs of 512 keep float64's accuracy (a run adds 32 values
    # per vector lane) at float32's vector width; 0 adds every value in acc_dtype.
    block: int = 0

    @property
    def row(self) -> CombineRow:
        return COMBINES[self.combine]


@dataclass(frozen=True)
class Pass:
    accumulates: tuple[Accumulate, ...] = ()
    stores: tuple[Store, ...] = ()  # evaluated at every inner point of this pass
    after: tuple[Store, ...] = ()  # evaluated once per outer index after the pass

    @property
    def values(self) -> list[Expr]:
        """Every expression the pass evaluates: accumulated, stored, stored after."""
        return [
            *(a.value for a in self.accumulates),
            *(s.value for s in (*self.stores, *self.after)),
        ]


@dataclass(frozen=True)
class Piece:
    """Iterations [start, start + var.extent) of a pointwise kernel's vector loop, run as
    `var` from 0 with stores specialised to them (lower/split.py)."""

    start: int
    var: Var
    stores: tuple[Store, ...]


class Schedule(StrEnum):
    """How a kernel's loops are laid out and shared between threads (lower/schedule.py)."""

    POINTWISE = "pointwise"  # one flat (or tiled) loop over the domain
    ROWS = "rows"  # each thread reduces whole rows, lanes along the reduced dims
    COLUMNS = "columns"  # lanes are neighbouring outputs (reductions over leading dims, pools)
    SPLIT = "split"  # few long rows: the threads share each row
    COLUMNS_SPLIT = "columns_split"  # columns, too few of them: the threads share the rows

    @property
    def shared_rows(self) -> bool:
        """Do the threads share each row (partials combined after a barrier)?"""
        return self in (Schedule.SPLIT, Schedule.COLUMNS_SPLIT)

    @property
    def columns(self) -> bool:
        return self in (Schedule.COLUMNS, Schedule.COLUMNS_SPLIT)


@dataclass(frozen=True)
class Kernel:
    name: str
    ops: tuple[str, ...]  # the ATen ops it fuses, in order
    buffers: tuple[Buffer, ...]
    outer: tuple[Var, ...]
    inner: tuple[Var, ...]
    passes: tuple[Pass, ...]
    schedule: Schedule = Schedule.POINTWISE
    reduction_size: int = 1  # elements folded into each accumulator
    checks: tuple[Expr, ...] = ()  # conditions that raise ZeroDivisionError when true
    # (output, input) buffer pairs that may share memory: every read of the input element
    # comes before the write of the output element at the same place (softmax, relu(x)).
    inplace: tuple[tuple[str, str], ...] = ()
    # pointwise only: the vector loop cut where a gather's position tests change answer;
    # () runs it whole with passes[0].stores
    pieces: tuple[Piece, ...] = ()
    # the kernel run as these kernels, one after the other, each over one range of an outer
    # variable with its position tests decided (lower/unswitch.py); () runs it whole
    cases: tuple[Kernel, ...] = ()
    # threads share the work or not, decided; None: by its size (`parallel`)
    threads: bool | None = None
    notes: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def inputs(self) -> list[Buffer]:
        return [b for b in self.buffers if b.role == "in"]

    @property
    def outputs(self) -> list[Buffer]:
        return [b for b in self.buffers if b.role == "out"]

    @property
    def bytes_read(self) -> int:
        return sum(b.nbytes for b in self.inputs)

    @property
    def bytes_written(self) -> int:
        return sum(b.nbytes for b in self.outputs)

    @property
    def outer_size(self) -> int:
        n = 1
        for v in self.outer:
            n *= v.extent
        return n

    @property
    def inner_size(self) -> int:
        n = 1
        for v in self.inner:
            n *= v.extent
        return n

    @property
    def work(self) -> int:
        """Elements of the domain (an ir.size.Size where the sizes are symbolic)."""
        return self.outer_size * self.inner_size

    @property
    def parallel(self) -> bool:
        """Whether threads share the work: below PARALLEL_MIN elements, waking the team
        costs more than it saves."""
        if self.threads is not None:
            return self.threads
        return self.schedule.shared_rows or self.work >= PARALLEL_MIN

    @property
    def parallel_at_run_time(self) -> bool:
        """Whether the kernel decides `parallel` when it runs: its size is symbolic (one
        kernel then serves the sizes on both sides of PARALLEL_MIN)."""
        return self.threads is None and not self.schedule.shared_rows and is_size(self.work)


def map_indices(
    k: Kernel, fix: Callable[[Ix], Ix], load: Callable[[str, Ix], Ix] | None = None
) -> Kernel:
    """k with `fix` applied to every index: loads, position tests, stores, guards; the
    loads' by `load(buffer, index)` instead where that is given."""
    memo: dict[Expr, Expr] = {}

    def expr(e: Expr) -> Expr:
        hit = memo.get(e)
        if hit is not None:
            return hit
        if e.op == "load":
            buf, ix = e.value
            new = Expr("load", (), e.dtype, (buf, load(buf, ix) if load else fix(ix)))
        elif e.op == "index":
            new = Expr("index", (), e.dtype, fix(e.value))
        elif e.args:
            new = Expr(e.op, tuple(expr(a) for a in e.args), e.dtype, e.value)
        else:
            new = e
        memo[e] = new
        return new

    return rewrite(k, expr, fix)


def rewrite(k: Kernel, expr: Callable[[Expr], Expr], fix: Callable[[Ix], Ix]) -> Kernel:
    """k with `expr` applied to every expression (accumulated, stored, checked) and `fix`
    to the indices outside them (stores, guards, argmax positions)."""
    passes = []
    for p in k.passes:
        passes.append(
            Pass(
                tuple(
                    replace(
                        a,
                        value=expr(a.value),
                        position=fix(a.position) if a.position is not None else None,
                    )
                    for a in p.accumulates
                ),
                tuple(_store(s, fix, expr) for s in p.stores),
                tuple(_store(s, fix, expr) for s in p.after),
            )
        )
    return replace(k, passes=tuple(passes), checks=tuple(expr(c) for c in k.checks))


def _store(s: Store, fix: Callable[[Ix], Ix], expr: Callable[[Expr], Expr]) -> Store:
    guard = fix(s.guard) if s.guard is not None else None
    return Store(s.buffer, fix(s.index), expr(s.value), guard)
