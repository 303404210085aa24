"""`opfuse explain` and `opfuse bisect`: load a model from MODULE:FACTORY, make inputs from
shape specs, and report. Mistakes in the command line are one-line errors, exit code 2."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Any

import torch

from ..report.tables import FusionReport, notes, short_name

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float64": torch.float64,
    "double": torch.float64, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "long": torch.int64,
    "int32": torch.int32, "int": torch.int32, "bool": torch.bool, "uint8": torch.uint8,
}  # fmt: skip


class UsageError(Exception):
    """A wrong module, factory or input spec: reported in one line."""


def load_model(target: str) -> torch.nn.Module:
    if ":" not in target:
        raise UsageError(f"expected MODULE:FACTORY, got {target!r}")
    where, name = target.rsplit(":", 1)
    is_file = where.endswith(".py") or os.sep in where
    # Imports resolve as `python -m` and `python file.py` would: from the current directory
    # for a module name, from the file's folder for a file (its sibling modules). The
    # installed `opfuse` script starts with neither on sys.path.
    folder = os.path.dirname(os.path.abspath(where)) if is_file else os.getcwd()
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        if is_file:
            if not os.path.exists(where):
                raise UsageError(f"no such file: {where}")
            spec = importlib.util.spec_from_file_location("opfuse_user_model", where)
            if spec is None or spec.loader is None:
                raise UsageError(f"cannot import {where}")
            module = importlib.util.module_from_spec(spec)
            sys.modules["opfuse_user_model"] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot import {where}: {type(e).__name__}: {e}") from e
    factory = getattr(module, name, None)
    if factory is None:
        raise UsageError(f"{where} has no {name!r}")
    if not callable(factory):
        raise UsageError(f"{where}.{name} is not callable")
    try:
        model = factory()
    except Exception as e:
        raise UsageError(f"{name}() failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{name}() returned {type(model).__name__}, not an nn.Module")
    return model


def parse_input(spec: str, default_dtype: str) -> torch.Tensor:
    """'1x3x224x224' or '8x128:int64' (a scalar is 'scalar')."""
    shape_text, _, dtype_text = spec.partition(":")
    dtype_name = dtype_text or default_dtype
    if dtype_name not in _DTYPES:
        raise UsageError(f"unknown dtype {dtype_name!r} (one of {', '.join(sorted(_DTYPES))})")
    dtype = _DTYPES[dtype_name]
    try:
        shape = (
            [] if shape_text in ("scalar", "") else [int(s) for s in shape_text.lower().split("x")]
        )
    except ValueError:
        raise UsageError(f"bad input shape {spec!r}: expected e.g. 1x3x224x224") from None
    if any(s < 0 for s in shape):
        raise UsageError(f"bad input shape {spec!r}: negative size")
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.randint(0, 2, shape, generator=g).to(dtype)


def _setup(args: argparse.Namespace) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    if not args.input:
        raise UsageError("give at least one --input shape, e.g. --input 1x3x224x224")
    model = load_model(args.target)
    return model, tuple(parse_input(s, args.dtype) for s in args.input)


def print_report(report: FusionReport) -> None:
    """A rich table (colours, fitted to the terminal) when rich is installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(report)
        return
    from ..report.picture import COLORS

    console = Console()
    t = Table(
        title=f"opfuse: {report.kernels_before} kernels before -> {report.kernels_after} after",
        expand=False,
    )
    for col in ("#", "pattern", "kernel", "ops", "modules", "why / how"):
        t.add_column(col, overflow="fold")
    for g in report.groups:
        color = COLORS.get(g.pattern, "#eeeeee")
        ops = ", ".join(short_name(o) for o in g.ops)
        if g.reads_through:
            ops += (
                " [dim](reads through " + ", ".join(short_name(o) for o in g.reads_through) + ")[/]"
            )
        t.add_row(
            str(g.id),
            f"[black on {color}]{g.pattern}[/]",
            g.kernel,
            ops,
            ", ".join(g.modules),
            g.reason or g.implementation,
        )
    console.print(t)
    colour = {"fold": "green", "not fused": "yellow"}
    for label, text in notes(report):
        if label:
            console.print(f"[{colour.get(label, 'cyan')}]{label}[/]: {text}", highlight=False)
        else:
            console.print(text, highlight=False)


def run(args: argparse.Namespace) -> int:
    """`opfuse explain`."""
    import opfuse

    try:
        model, inputs = _setup(args)
        report = opfuse.explain(model, inputs, dynamic_shapes=_dynamic(args.dynamic, inputs))
    except UsageError as e:
        print(f"opfuse explain: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print_report(report)
    if args.html:
        with open(args.html, "w") as f:
            f.write(report.to_html())
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(report.to_svg())
    return 0


def run_bisect(args: argparse.Namespace) -> int:
    """`opfuse bisect`: name the fusion that makes the output differ from eager."""
    from .bisect import bisect

    try:
        model, inputs = _setup(args)
    except UsageError as e:
        print(f"opfuse bisect: error: {e}", file=sys.stderr)
        return 2
    result = bisect(model, inputs, rtol=args.rtol, atol=args.atol)
    print(result.message)
    return 1 if result.without_fusion else 0


def _dynamic(given: list[str], inputs: tuple[Any, ...]) -> tuple[dict[int, Any], ...] | None:
    """`--dynamic K:D` (input K's dim D symbolic) as explain's dynamic_shapes."""
    if not given:
        return None
    dims: list[dict[int, Any]] = [{} for _ in inputs]
    for item in given:
        try:
            k, d = (int(x) for x in item.split(":"))
        except ValueError:
            raise UsageError(f"--dynamic {item}: expected INPUT:DIM, e.g. 0:1") from None
        if not 0 <= k < len(inputs):
            raise UsageError(f"--dynamic {item}: there are {len(inputs)} inputs")
        if not 0 <= d < inputs[k].dim():
            raise UsageError(f"--dynamic {item}: input {k} has {inputs[k].dim()} dims")
        dims[k][d] = torch.export.Dim.AUTO
    return tuple(dims)


def add_arguments(p: argparse.ArgumentParser, outputs: bool) -> None:
    p.add_argument("target", help="MODULE:FACTORY (an importable module or a .py file path)")
    p.add_argument("--input", action="append", default=[], help="a shape, e.g. 1x3x224x224[:int64]")
    p.add_argument("--dtype", default="float32", help="dtype of inputs without their own")
    if outputs:
        p.add_argument(
            "--dynamic",
            action="append",
            default=[],
            help="INPUT:DIM, e.g. 0:1: that size symbolic (the report says if it stays so)",
        )
        p.add_argument("--json", action="store_true", help="print the report as JSON")
        p.add_argument("--html", help="write a self-contained HTML report here")
        p.add_argument("--svg", help="write the graph picture here")
    else:
        p.add_argument("--rtol", type=float, default=1e-4)
        p.add_argument("--atol", type=float, default=1e-5)
