"""The public entry points: compile, explain, refresh."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .compiled import (
    CompiledModule,
    RecompileError,
    fallback_message,
    forget_copies,
    torch_compile,
)
from .frontend.capture import CaptureError, capture_module
from .frontend.symbolic import export_family, given_dims
from .options import Options
from .pipeline import compile_graph, warn_once
from .report.make import count_kernels
from .report.tables import FusionReport, RejectReport


def _as_args(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs
    return (example_inputs,)


class _Function(torch.nn.Module):
    """A plain function as a module: it has no training mode and nothing to freeze but
    the tensors it closes over, so it compiles as inference (autograd through its inputs
    still works, through torch.compile)."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn
        self.eval()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _as_module(model: Any) -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        return model
    if callable(model):
        return _Function(model)
    raise TypeError(f"opfuse: expected a torch.nn.Module or a function, got {type(model).__name__}")


def _as_options(options: Options | Mapping[str, Any] | None, where: str) -> Options:
    """opfuse.compile's and explain's `options`: an Options, or a mapping of its fields'
    names (as torch.compile's `options` for the backend take them)."""
    if options is None or isinstance(options, Options):
        return options or Options()
    return Options.of(options, where)


def compile(
    model: torch.nn.Module | Callable[..., Any],
    example_inputs: Any,
    *,
    example_kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    recompile: bool = True,
    cache_limit: int | None = None,
    options: Options | Mapping[str, Any] | None = None,
) -> torch.nn.Module:
    """Compile `model` (a module or a function) for inputs like `example_inputs` (a tensor
    or a tuple of args).

    In eval mode, parameters and buffers are frozen into the graph and a `CompiledModule`
    is returned (its `.report` is the FusionReport). In training mode the model goes
    through `torch.compile(backend="opfuse")`: forward and backward are both compiled.
    The caller's module and tensors are never modified. New input shapes, strides or dtypes
    compile again, up to `cache_limit` signatures (default: 8, or 64 sizes of one export
    with symbolic sizes while their memory pools stay under 1 GiB); later new ones run the
    model with torch, unfused, with a warning (`recompile=False`: they raise
    RecompileError, unless `dynamic_shapes` declared their sizes).

    `dynamic_shapes` (torch.export's form, per argument of the model's forward) makes those
    sizes symbolic from the first compile. Without it, the first input shape that differs
    from the first one only in tensor sizes exports the model once more with the dims that
    changed symbolic. Shapes such an export admits are captured from it at their sizes and
    share its C builds and tuning (a new sequence length: ~0.5 s, no C compiler run).
    """
    model = _as_module(model)
    if cache_limit is not None and cache_limit < 1:
        raise ValueError(f"opfuse: cache_limit must be at least 1, got {cache_limit}")
    opts = _as_options(options, "opfuse.compile")
    if model.training:
        # declared dynamic sizes: dynamo's graphs take every size symbolic
        dynamic = True if dynamic_shapes is not None else None
        return torch_compile(model, opts, dynamic)
    args = _as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    try:
        return CompiledModule(model, args, kwargs, opts, recompile, cache_limit, dynamic_shapes)
    except CaptureError as e:
        warn_once(f"opfuse: {e}; compiling through torch.compile instead")
    return torch_compile(model, opts)


def refresh() -> None:
    """Under `torch.compile(backend="opfuse")`, an inference graph compiles with the
    parameters as constants (folded, packed) and compiles again when one is replaced or
    its version counter moves. After writes that bypass version counters (`p.data.mul_()`,
    through numpy), call this: every copy made from a parameter (packed weights, folded
    BatchNorms, shared by every compile that made it alike) is forgotten, and each graph
    compiles or packs again on its next call. (A module from opfuse.compile has its own
    `.refresh()`, which calls this.)"""
    forget_copies()


def explain(
    model: torch.nn.Module | Callable[..., Any],
    example_inputs: Any,
    *,
    example_kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    options: Options | Mapping[str, Any] | None = None,
) -> FusionReport:
    """The FusionReport of compiling `model` (a module or a function): groups, patterns,
    folds, refusals. With `dynamic_shapes` (as for compile), the compile at the example
    inputs' sizes from an export with those sizes symbolic, and which ones it kept so."""
    model = _as_module(model)
    opts = _as_options(options, "opfuse.explain")
    args = _as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    if not model.training:
        try:
            if dynamic_shapes is not None:
                dims = given_dims(model, args, kwargs, dynamic_shapes)
                captured = export_family(model, args, kwargs, dims).capture(
                    pytree.tree_leaves((args, kwargs))
                )
            else:
                captured = capture_module(model, args, kwargs)
            report = compile_graph(captured.graph, opts, captured.eager_kernels).report
            if captured.dynamic:
                report.dynamic.append(captured.dynamic)
            return report
        except CaptureError as e:
            warn_once(f"opfuse: {e}; explaining the torch.compile path instead")
        except Exception as e:  # explain what the fallback compile() takes runs
            warn_once(fallback_message(e))
    from .frontend.dynamo import collect_reports

    # Training mode runs the model once; a copy keeps the caller's running stats intact.
    report = collect_reports(copy.deepcopy(model), args, kwargs, options=opts)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            report.rejected.append(
                RejectReport(
                    "",
                    name,
                    "training mode: BatchNorm normalises with batch statistics and is not folded",
                )
            )
    return report


__all__ = ["CompiledModule", "RecompileError", "compile", "count_kernels", "explain"]
