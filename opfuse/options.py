"""Compiler switches: one Options per compile, defaults from the environment (OPFUSE_*)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .lower.groups import IMPLEMENTATIONS
from .settings import check, flag


@dataclass
class Options:
    """Compiler switches. Defaults come from the environment (OPFUSE_*)."""

    fuel: int | None = field(default_factory=lambda: _env_int("OPFUSE_FUEL"))
    # a folder: the graph after every rewrite, the generated source and the report
    debug_dir: str | None = field(default_factory=lambda: os.environ.get("OPFUSE_DEBUG_DIR"))
    # check the graph after every rewrite (ir/verify.py); on under the tests
    verify: bool = field(default_factory=lambda: flag("OPFUSE_VERIFY"))
    fold_batchnorm: bool = True
    fuse_attention: bool = True  # matmul-softmax-matmul as one fused attention call
    freeze: bool = True  # parameters are constants (eval-mode opfuse.compile)
    # "channels-last": frozen conv graphs run NHWC between convolutions; "keep": as captured.
    layout: str = field(default_factory=lambda: os.environ.get("OPFUSE_LAYOUT") or "channels-last")
    # Force how epilogue and library groups run (one of lower.groups.IMPLEMENTATIONS:
    # "unfused", "blocked", "onednn", ...) where that is possible, instead of measuring:
    # for tests and for bisecting.
    implementation: str | None = field(
        default_factory=lambda: os.environ.get("OPFUSE_IMPLEMENTATION") or None
    )
    # "kernel": rand_like/rand (dropout) drawn inside the kernels that use them, from a
    # counter-based generator seeded by torch's; "torch": torch's own rand calls.
    random: str = field(default_factory=lambda: os.environ.get("OPFUSE_RANDOM") or "kernel")
    # "c": C with OpenMP (CPU tensors); "triton": Triton kernels (the interpreter runs them
    # on CPU tensors with TRITON_INTERPRET=1), library calls with torch; "auto": Triton
    # for graphs on a GPU, C otherwise.
    backend: str = field(default_factory=lambda: os.environ.get("OPFUSE_BACKEND") or "auto")

    def __post_init__(self) -> None:
        # Checked here, not where they are read: a compile that fails later falls back to
        # torch with a warning, and a misspelt option must be an error instead.
        for name, allowed in (
            ("random", ("kernel", "torch")),
            ("layout", ("channels-last", "keep")),
            ("backend", ("auto", "c", "triton")),
            ("implementation", (None, *IMPLEMENTATIONS)),
            ("fold_batchnorm", (True, False)),
            ("fuse_attention", (True, False)),
            ("freeze", (True, False)),
            ("verify", (True, False)),
        ):
            env = f" (or {_ENV[name]})" if name in _ENV else ""
            check(f"Options.{name}{env}", getattr(self, name), allowed)
        if self.fuel is not None and (not isinstance(self.fuel, int) or self.fuel < 0):
            raise ValueError(
                f"Options.fuel (or OPFUSE_FUEL) must be a count >= 0, not {self.fuel!r}"
            )


# The environment variable behind each Options field that has one.
_ENV = {
    "fuel": "OPFUSE_FUEL",
    "debug_dir": "OPFUSE_DEBUG_DIR",
    "verify": "OPFUSE_VERIFY",
    "layout": "OPFUSE_LAYOUT",
    "implementation": "OPFUSE_IMPLEMENTATION",
    "random": "OPFUSE_RANDOM",
    "backend": "OPFUSE_BACKEND",
}


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {v!r}") from None
