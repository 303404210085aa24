"""Bisect a numerical difference to one fusion, with optimization fuel.

With fuel N opfuse performs only its first N fusions. If the full compile differs from
eager and fuel 0 does not, some fusion k breaks it: binary search for the smallest fuel
that differs; fusion number k is the culprit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..frontend.structure import flatten
from ..options import Options


@dataclass
class BisectResult:
    message: str
    fuel: int | None = None  # smallest fuel that shows the difference
    fusion: tuple[str, str] | None = None  # (producer, consumer) of that fusion
    without_fusion: bool = False  # the difference is there even with no fusion
    compiles: int = 0


def _differs(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    fuel: int | None,
    expected: list[torch.Tensor],
    rtol: float,
    atol: float,
) -> tuple[bool, Any]:
    import opfuse

    fast = opfuse.compile(model, inputs, options=Options(fuel=fuel))
    with torch.no_grad():
        got = flatten(fast(*inputs))[0]
    bad = len(got) != len(expected) or any(
        a.shape != b.shape or not torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        for a, b in zip(got, expected)
    )
    return bad, getattr(fast, "report", None)


def bisect(
    model: torch.nn.Module, inputs: tuple[Any, ...], rtol: float = 1e-4, atol: float = 1e-5
) -> BisectResult:
    with torch.no_grad():
        expected = flatten(model(*inputs))[0]
    bad, report = _differs(model, inputs, None, expected, rtol, atol)
    compiles = 1
    if not bad:
        return BisectResult("opfuse matches eager: nothing to bisect", compiles=compiles)
    fusions = report.fusions if report is not None else []
    bad0, _ = _differs(model, inputs, 0, expected, rtol, atol)
    compiles += 1
    if bad0:
        return BisectResult(
            "the output differs even with no fusion (OPFUSE_FUEL=0): a single-op kernel or "
            "a rewrite (BatchNorm folding, constant folding) is the cause",
            fuel=0,
            without_fusion=True,
            compiles=compiles,
        )
    lo, hi = 0, len(fusions)  # fuel lo matches, fuel hi differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        bad_mid, _ = _differs(model, inputs, mid, expected, rtol, atol)
        compiles += 1
        if bad_mid:
            hi = mid
        else:
            lo = mid
    producer, consumer = fusions[hi - 1]
    return BisectResult(
        f"fusion #{hi} ({producer} -> {consumer}) makes the output differ from eager; "
        f"OPFUSE_FUEL={hi - 1} runs without it",
        fuel=hi,
        fusion=(producer, consumer),
        compiles=compiles,
    )
