"""Compiler switches: one Options per compile, defaults from the environment (OPFUSE_*)."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .lower.groups import IMPLEMENTATIONS
from .settings import check, flag


def _env(var: str, read: Callable[[str], Any]) -> Any:
    """A field whose default `read(var)` takes from environment variable `var` (which
    error messages then name beside the field)."""
    return field(default_factory=lambda: read(var), metadata={"env": var})


def _text(default: str | None) -> Callable[[str], str | None]:
    return lambda var: os.environ.get(var) or default


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {v!r}") from None


@dataclass
class Options:
    """Compiler switches. Defaults come from the environment (OPFUSE_*)."""

    fuel: int | None = _env("OPFUSE_FUEL", _env_int)
    # a folder: the graph after every rewrite, the generated source and the report
    debug_dir: str | None = _env("OPFUSE_DEBUG_DIR", os.environ.get)
    # check the graph after every rewrite (ir/verify.py); on under the tests
    verify: bool = _env("OPFUSE_VERIFY", flag)
    fold_batchnorm: bool = True
    fuse_attention: bool = True  # matmul-softmax-matmul as one fused attention call
    # 1x1 and depthwise convolutions over channels-last input as rows: a matmul, opfuse's
    # depthwise kernel (rewrite/conv_rows.py); those over a few input channels (stems) as
    # its direct kernel; each timed against oneDNN's convolution
    conv_rows: bool = True
    # 3x3, stride-1 convolutions over channels-last input also as rows for opfuse's Winograd
    # kernel (backends/c/winograd.py), timed against oneDNN's convolution
    winograd: bool = True
    freeze: bool = True  # parameters are constants (eval-mode opfuse.compile)
    # "channels-last": frozen conv graphs run NHWC between convolutions; "keep": as captured.
    layout: str = _env("OPFUSE_LAYOUT", _text("channels-last"))
    # Force how epilogue and library groups run (one of lower.groups.IMPLEMENTATIONS:
    # "unfused", "blocked", "onednn", ...) where that is possible, instead of measuring:
    # for tests and for bisecting.
    implementation: str | None = _env("OPFUSE_IMPLEMENTATION", _text(None))
    # "kernel": rand_like/rand (dropout) drawn inside the kernels that use them, from a
    # counter-based generator seeded by torch's; "torch": torch's own rand calls.
    random: str = _env("OPFUSE_RANDOM", _text("kernel"))
    # "c": C with OpenMP (CPU tensors); "triton": Triton kernels (the interpreter runs them
    # on CPU tensors with TRITON_INTERPRET=1), library calls with torch; "auto": Triton
    # for graphs on a GPU, C otherwise.
    backend: str = _env("OPFUSE_BACKEND", _text("auto"))

    @classmethod
    def of(
        cls, given: Mapping[str, Any], where: str, *, extra: Collection[str] = (), **fixed: Any
    ) -> Options:
        """Options from a mapping of field names (the form torch.compile's `options` take),
        with `fixed` set: a name that is no field, or one of `fixed`, is a ValueError that
        lists the valid ones. Names in `extra` are the caller's to read and are skipped."""
        if not isinstance(given, Mapping):
            raise TypeError(
                f"{where}: options must be an opfuse.Options or a dict of its fields, "
                f"not {type(given).__name__}"
            )
        names = ({f.name for f in fields(cls)} - set(fixed)) | set(extra)
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(
                f"{where}: unknown options {unknown}; valid: {', '.join(sorted(names))}"
            )
        return cls(**{k: v for k, v in given.items() if k not in extra}, **fixed)

    def __post_init__(self) -> None:
        # Checked here, not where they are read: a compile that fails later falls back to
        # torch with a warning, and a misspelt option must be an error instead.
        env = {f.name: f.metadata["env"] for f in fields(self) if "env" in f.metadata}
        for name, allowed in (
            ("random", ("kernel", "torch")),
            ("layout", ("channels-last", "keep")),
            ("backend", ("auto", "c", "triton")),
            ("implementation", (None, *IMPLEMENTATIONS)),
            ("fold_batchnorm", (True, False)),
            ("fuse_attention", (True, False)),
            ("conv_rows", (True, False)),
            ("winograd", (True, False)),
            ("freeze", (True, False)),
            ("verify", (True, False)),
        ):
            var = env.get(name)
            check(f"Options.{name}{f' (or {var})' if var else ''}", getattr(self, name), allowed)
        if self.fuel is not None and (not isinstance(self.fuel, int) or self.fuel < 0):
            raise ValueError(
                f"Options.fuel (or OPFUSE_FUEL) must be a count >= 0, not {self.fuel!r}"
            )
