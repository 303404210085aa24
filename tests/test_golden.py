"""Generated source of a few fixed graphs, kept in tests/golden/: a change to what the
renderers write shows here as a diff to look at (and to accept with
OPFUSE_UPDATE_GOLDEN=1). Kernel schedules do not depend on the machine (thread counts
only size GEMM tiles, which these graphs do not have); the preludes are not included."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opfuse
from opfuse.pipeline import Options

GOLDEN = Path(__file__).parent / "golden"


def _ln_residual(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x + r, (96,)) * 1.5 + 0.25


CASES: dict[str, tuple[Callable[..., object], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "gelu_bias_chain": (
        lambda x, b: F.gelu(x + b) * torch.sigmoid(x) - 0.5,
        lambda: (torch.randn(32, 96), torch.randn(96)),
    ),
    "layernorm_residual": (_ln_residual, lambda: (torch.randn(4, 8, 96), torch.randn(4, 8, 96))),
    "softmax_transposed": (
        lambda x: x.transpose(0, 1).softmax(-1),
        lambda: (torch.randn(50, 12),),
    ),
    "argmax_var": (
        lambda x: (x.argmax(1), x.var(1), x.amin(1)),
        lambda: (torch.randn(16, 70),),
    ),
}


class _Fn(nn.Module):
    def __init__(self, fn: Callable[..., object]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> object:
        return self.fn(*args)


def _source(name: str, options: Options | None) -> str:
    fn, make = CASES[name]
    torch.manual_seed(0)
    f = opfuse.compile(_Fn(fn).eval(), make(), options=options)
    entry = next(iter(f._entries.values()))
    assert entry.compiled is not None
    return entry.compiled.source


def _compare(path: Path, text: str) -> None:
    if os.environ.get("OPFUSE_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"no golden file {path.name}: run with OPFUSE_UPDATE_GOLDEN=1"
    assert text == path.read_text(), (
        f"generated source changed for {path.name}; if intended, run with "
        "OPFUSE_UPDATE_GOLDEN=1 and review the diff"
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_c_source_is_unchanged(name: str) -> None:
    _compare(GOLDEN / f"{name}.c", _source(name, Options(backend="c")))


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_source_is_unchanged(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from opfuse.backends.triton.render import PRELUDE

    kernels = _source(name, Options(backend="triton")).split(PRELUDE, 1)[1]  # (helpers: once)
    _compare(GOLDEN / f"{name}.py", kernels)
