"""`opfuse.fold_batchnorm(module)`: a new module with inference BatchNorms folded into the
convs and linears before them. The original module is left untouched.

Which BatchNorm follows which conv is read off the model's dataflow: from torch.export when
example inputs are given, else from torch.fx symbolic tracing, else (untraceable models)
from adjacency inside nn.Sequential containers, where order is dataflow.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import torch
import torch.nn as nn

from ..rewrite.batchnorm import BN_INFERENCE, Refusal, _label, _plan, fold_weights
from .capture import CaptureError, capture_module, module_calls_fx

_CONVS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def fold_batchnorm(module: nn.Module, example_inputs: Any = None) -> nn.Module:
    """Return a copy of `module` with every foldable BatchNorm folded into the conv or
    linear before it and replaced by nn.Identity. The copy carries `.batchnorm_folds`
    (pairs of module names) and `.batchnorm_refusals` (module, reason)."""
    new = copy.deepcopy(module)
    refusals: list[tuple[str, str]] = []
    if module.training:
        warnings.warn(
            "opfuse.fold_batchnorm: the module is in training mode, where BatchNorm uses "
            "batch statistics; nothing was folded (call .eval() first)",
            RuntimeWarning,
            stacklevel=2,
        )
        new.batchnorm_folds = []  # type: ignore[assignment]
        new.batchnorm_refusals = [("<model>", "training mode")]  # type: ignore[assignment]
        return new
    pairs, refused = _pairs(module, example_inputs)
    refusals.extend(refused)
    done: list[tuple[str, str]] = []
    for conv_name, bn_name in pairs:
        reason = _apply(new, conv_name, bn_name)
        if reason:
            refusals.append((bn_name, reason))
        else:
            done.append((conv_name, bn_name))
    new.batchnorm_folds = done  # type: ignore[assignment]
    new.batchnorm_refusals = refusals  # type: ignore[assignment]
    return new


def _pairs(
    module: nn.Module, example_inputs: Any
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    if example_inputs is not None:
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        try:
            return _pairs_from_graph(module, args)
        except CaptureError:
            pass
    calls = module_calls_fx(module)
    if calls is not None:
        return _pairs_from_calls(module, calls), []
    return _pairs_from_sequential(module), []


def _pairs_from_graph(
    module: nn.Module, args: tuple[Any, ...]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    graph = capture_module(module, args).graph
    pairs, refused = [], []
    for n in graph.nodes:
        if n.op != BN_INFERENCE:
            continue
        plan, reason = _plan(graph, n)
        if plan is None:
            refused.append((_label(n), reason))
        else:
            pairs.append((_label(plan.producer), _label(n)))
    return pairs, refused


def _pairs_from_calls(
    module: nn.Module, calls: list[tuple[str, str | None, int]]
) -> list[tuple[str, str]]:
    """calls: (module called, the module whose output it reads or None, users of output)."""
    count: dict[str, int] = {}
    for name, _, _ in calls:
        count[name] = count.get(name, 0) + 1
    users = {name: u for name, _, u in calls}
    pairs = []
    for name, src, _ in calls:
        if src is None or count[name] != 1 or count.get(src, 0) != 1 or users.get(src) != 1:
            continue
        if isinstance(_get(module, name), _BNS) and isinstance(
            _get(module, src), (*_CONVS, nn.Linear)
        ):
            pairs.append((src, name))
    return pairs


def _pairs_from_sequential(module: nn.Module) -> list[tuple[str, str]]:
    pairs = []
    seen: dict[int, int] = {}
    for m in module.modules():
        seen[id(m)] = seen.get(id(m), 0) + 1
    for prefix, m in module.named_modules():
        if not isinstance(m, nn.Sequential):
            continue
        items = list(m.named_children())
        for (a_name, a), (b_name, b) in itertools.pairwise(items):
            if isinstance(a, (*_CONVS, nn.Linear)) and isinstance(b, _BNS):
                pairs.append((f"{prefix}.{a_name}".lstrip("."), f"{prefix}.{b_name}".lstrip(".")))
    return pairs


def _get(root: nn.Module, name: str) -> nn.Module:
    return root.get_submodule(name) if name else root


def _apply(root: nn.Module, conv_name: str, bn_name: str) -> str:
    try:
        conv, bn = _get(root, conv_name), _get(root, bn_name)
    except AttributeError:
        return "module not found"
    if not isinstance(bn, _BNS):
        return f"{type(bn).__name__} is not a BatchNorm"
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return "BatchNorm has no running statistics (track_running_stats=False)"
    if isinstance(conv, nn.Linear):
        transposed, groups = False, 1
    elif isinstance(conv, _CONVS):
        transposed, groups = isinstance(conv, nn.modules.conv._ConvTransposeNd), conv.groups
    else:
        return f"{type(conv).__name__} is not a conv or linear"
    w, b = fold_weights(
        conv.weight,
        conv.bias,
        bn.weight if bn.affine else None,
        bn.bias if bn.affine else None,
        bn.running_mean,
        bn.running_var,
        bn.eps,
        transposed=transposed,
        groups=groups,
    )
    with torch.no_grad():
        conv.weight = nn.Parameter(w, requires_grad=conv.weight.requires_grad)
        conv.bias = nn.Parameter(b, requires_grad=conv.weight.requires_grad)
    parent_name, _, attr = bn_name.rpartition(".")
    setattr(_get(root, parent_name), attr, nn.Identity())
    return ""


__all__ = ["Refusal", "fold_batchnorm"]
