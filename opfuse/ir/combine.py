"""How a reduction folds values: one table row per combine, as `scalar.PRIMS` is for the
pointwise primitives. Lowering and both backends read these rows instead of branching on
names; a new combine is a new row (and, if it needs one, a new Family)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .strenum import StrEnum


class Combine(StrEnum):
    SUM = "sum"
    PROD = "prod"
    ANY = "any"
    ALL = "all"
    MAX = "max"
    MIN = "min"
    ARGMAX = "argmax"
    ARGMIN = "argmin"
    WELFORD = "welford"


class Family(Enum):
    """How the backends render a combine's update and merge."""

    FOLD = "fold"  # acc = acc OP v, with an associative operator
    SELECT = "select"  # acc = the extreme of acc and v; NaN wins
    ARGSELECT = "argselect"  # (value, position) of the extreme; NaN wins, then the first
    WELFORD = "welford"  # running (mean, m2, count): Welford's update, Chan's merge


class Identity(Enum):
    ZERO = "0"
    ONE = "1"
    LOWEST = "lowest"  # -inf, or the dtype's minimum for integers
    HIGHEST = "highest"  # +inf, or the dtype's maximum


@dataclass(frozen=True)
class CombineRow:
    family: Family
    identity: Identity
    parts: tuple[str, ...]  # the results a kernel reads: Expr("acc", value=(name, part))
    op: str = ""  # FOLD: the C / Triton operator; SELECT/ARGSELECT: "max" or "min"
    omp: str | None = None  # the OpenMP reduction identifier, when OpenMP can do it
    triton_merge: str = ""  # the prelude function tl.reduce merges two partials with
    logical: bool = False  # any/all: operands are truth values, results bool
    # Max/min compare values exactly in the input's opmath dtype; everything else folds
    # in the accumulator dtype.
    exact: bool = False
    # FOLD/SELECT: the scalar primitive (scalar.PRIMS) that folds two values, for a row
    # written out as an expression (lower/unroll.py)
    prim: str = ""

    @property
    def extreme_lo(self) -> bool:
        """Does the fold start from the lowest value (max, argmax)?"""
        return self.identity is Identity.LOWEST


# fmt: off
COMBINES: dict[Combine, CombineRow] = {
    Combine.SUM: CombineRow(Family.FOLD, Identity.ZERO, ("value",), "+", "+", "combine_sum",
                            prim="add"),
    Combine.PROD: CombineRow(Family.FOLD, Identity.ONE, ("value",), "*", "*", "combine_prod",
                             prim="mul"),
    Combine.ANY: CombineRow(Family.FOLD, Identity.ZERO, ("value",), "|", "|", "combine_or",
                            logical=True, prim="or"),
    Combine.ALL: CombineRow(Family.FOLD, Identity.ONE, ("value",), "&", "&", "combine_and",
                            logical=True, prim="and"),
    Combine.MAX: CombineRow(Family.SELECT, Identity.LOWEST, ("value",), "max", "max", "op_max",
                            exact=True, prim="max"),
    Combine.MIN: CombineRow(Family.SELECT, Identity.HIGHEST, ("value",), "min", "min", "op_min",
                            exact=True, prim="min"),
    Combine.ARGMAX: CombineRow(Family.ARGSELECT, Identity.LOWEST, ("value", "index"), "max",
                               triton_merge="combine_argmax", exact=True),
    Combine.ARGMIN: CombineRow(Family.ARGSELECT, Identity.HIGHEST, ("value", "index"), "min",
                               triton_merge="combine_argmin", exact=True),
    Combine.WELFORD: CombineRow(Family.WELFORD, Identity.ZERO, ("mean", "m2"),
                                triton_merge="combine_welford"),
}
# fmt: on
