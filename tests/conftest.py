"""Shared test helpers. torch eager is the oracle: a fused result must match eager, or,
where strict comparison fails, be no further from a float64 reference than eager is."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (HYPOTHESIS_PROFILE=explore draws new
# ones): a random draw that finds a known weakness (float32 sums whose order differs can be
# >4x eager's error on one row) must not turn an unrelated change's CI red at random.
settings.register_profile("opfuse", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "opfuse"))

# A private kernel cache per test session: tests exercise compilation, not a warm cache.
os.environ.setdefault("OPFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="opfuse-test-cache-"))
# Every rewritten graph is checked (ir/verify.py): a pass that breaks one fails where it does.
os.environ.setdefault("OPFUSE_VERIFY", "1")
# Every size a compile serves at others' sizes is compiled too and compared (runtime/
# sized.py): a decision the compile took from a size without recording it fails there.
os.environ.setdefault("OPFUSE_CHECK_SERVED", "1")
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _warnings_once_per_test() -> None:
    """opfuse warns once per process (pipeline.warn_once): each test that expects a warning
    sees it whatever ran before it."""
    from opfuse import pipeline

    pipeline._warned.clear()


def _leaves(x: Any) -> list[Any]:
    import torch.utils._pytree as pytree

    from opfuse.frontend import structure

    leaves, _ = structure.flatten(x)
    return leaves if leaves else pytree.tree_leaves(x)


def _to64(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    if isinstance(x, (list, tuple)):
        return type(x)(_to64(v) for v in x)
    if isinstance(x, dict):
        return {k: _to64(v) for k, v in x.items()}
    return x


def assert_matches_eager(
    model: Any,
    ours: Any,
    args: tuple[Any, ...],
    kwargs: dict | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """`ours` is the fused output for model(*args); compare it with eager."""
    kwargs = kwargs or {}
    with torch.no_grad():
        ref = model(*args, **kwargs)
    a, b = _leaves(ours), _leaves(ref)
    assert len(a) == len(b), f"{len(a)} outputs, eager has {len(b)}"
    ref64 = None
    for i, (o, r) in enumerate(zip(a, b)):
        assert o.shape == r.shape, f"output {i}: shape {tuple(o.shape)} vs eager {tuple(r.shape)}"
        assert o.dtype == r.dtype, f"output {i}: dtype {o.dtype} vs eager {r.dtype}"
        try:
            torch.testing.assert_close(o, r, rtol=rtol, atol=atol, equal_nan=True)
            continue
        except AssertionError:
            if ref64 is None:
                ref64 = _reference64(model, args, kwargs)
        r64 = _leaves(ref64)[i]
        if not r.is_floating_point():
            # Integer results of float math: no more elements off float64's answer than eager.
            ours_off = int((o != r64.to(o.dtype)).sum())
            eager_off = int((r != r64.to(r.dtype)).sum())
            assert ours_off <= eager_off, (
                f"output {i}: {ours_off} elements differ, eager {eager_off}"
            )
            continue
        err_ours = _err(o, r64)
        err_eager = _err(r, r64)
        # float64 tiebreak: no further from float64 than eager is (with 1 ulp of slack)
        eps = torch.finfo(r.dtype).eps * max(1.0, r64.abs().max().item())
        assert err_ours <= err_eager * 1.0 + eps, (
            f"output {i}: max error vs float64 {err_ours:.3e}, eager's {err_eager:.3e}"
        )


def assert_no_worse(
    ours: torch.Tensor,
    eager: torch.Tensor,
    ref64: torch.Tensor,
    what: str = "",
    factor: float = 1.0,
) -> None:
    """The oracle rule for one tensor: close to eager, or no further from float64 than
    `factor` times eager's distance (plus one ulp of the largest value)."""
    try:
        torch.testing.assert_close(ours, eager, equal_nan=True)
        return
    except AssertionError:
        pass
    e_ours, e_eager = _err(ours, ref64), _err(eager, ref64)
    eps = torch.finfo(eager.dtype).eps * max(1.0, ref64.abs().max().item())
    assert e_ours <= e_eager * factor + eps, (
        f"{what}: error vs float64 {e_ours:.3e}, eager's {e_eager:.3e}"
    )


def _err(x: torch.Tensor, ref: torch.Tensor) -> float:
    d = (x.double() - ref.double()).abs()
    # the same value (equal infinities included: inf - inf is NaN) or NaN in both: no error
    same = (x.double() == ref) | (torch.isnan(x.double()) & torch.isnan(ref))
    d = torch.where(same, torch.zeros_like(d), d)
    d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
    return d.max().item() if d.numel() else 0.0


def _reference64(model: Any, args: tuple[Any, ...], kwargs: dict) -> Any:
    m64 = copy.deepcopy(model)
    if isinstance(m64, torch.nn.Module):
        m64 = m64.double()
    with torch.no_grad():
        return m64(*_to64(args), **_to64(kwargs))


class Fn(torch.nn.Module):
    """Wrap a function as a module."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@pytest.fixture
def fresh_cache(tmp_path: Any, monkeypatch: Any) -> Any:
    d = tmp_path / "cache"
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(d))
    return d


def caches_of_the_reference_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiling regimes follow the CPU's caches (opfuse's GEMM splits rows where A passes L1:
    from 86 rows of 96 on a 32 KiB L1, a second build): tests that count builds over sizes
    run with the caches of the host their sizes were chosen on (L1 48 KiB, L2 1 MiB)."""
    from opfuse.tools import caches

    monkeypatch.setattr(caches, "_levels", lambda: {1: 48 << 10, 2: 1 << 20, 3: 32 << 20})


def count_compiler_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time the C compiler runs (a library built)."""
    from opfuse.backends.c import build

    runs: list[int] = []
    real = build._compile

    def counting(*a: Any) -> None:
        runs.append(1)
        real(*a)

    monkeypatch.setattr(build, "_compile", counting)
    return runs
