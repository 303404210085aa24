"""`libdevice` for generated kernels: Triton's own on a GPU; under the interpreter
(TRITON_INTERPRET=1), which cannot call external device libraries, the same functions
computed with numpy on the interpreter's arrays."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Any

import numpy as np


def _interpreted() -> Any:
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def wrap(fn: Any) -> Any:
        def call(*args: Any) -> Any:
            ts = [a for a in args if isinstance(a, tl.tensor)]
            ref = max(ts, key=lambda t: len(t.shape))
            arrays = [a.handle.data if isinstance(a, tl.tensor) else a for a in args]
            dtype = ref.handle.data.dtype
            with np.errstate(all="ignore"):
                out = np.asarray(fn(*arrays)).astype(dtype)
            scalar = ref.type.scalar
            ty = tl.block_type(scalar, list(out.shape)) if out.shape else scalar
            return tl.tensor(TensorHandle(out, scalar), ty)

        return call

    def vec(f: Any) -> Any:
        v = np.vectorize(f, otypes=[np.float64])
        return lambda x: v(x.astype(np.float64))

    def fma(a: Any, b: Any, c: Any) -> Any:
        # float32 products are exact in float64; float64 operands round twice here
        wide = np.longdouble if np.asarray(a).dtype == np.float64 else np.float64
        return np.asarray(a, wide) * np.asarray(b, wide) + np.asarray(c, wide)

    table = {
        "fma": fma, "trunc": np.trunc, "floor": np.floor, "ceil": np.ceil, "nearbyint": np.rint,
        "fmod": np.fmod, "pow": np.power, "fmax": np.fmax, "fmin": np.fmin,
        "atan2": np.arctan2, "copysign": np.copysign, "hypot": np.hypot,
        "exp": np.exp, "exp2": np.exp2, "expm1": np.expm1, "log": np.log, "log2": np.log2,
        "log10": np.log10, "log1p": np.log1p, "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos,
        "tan": np.tan, "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan,
        "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh, "asinh": np.arcsinh,
        "acosh": np.arccosh, "atanh": np.arctanh, "signbit": np.signbit,
        "erf": vec(math.erf), "erfc": vec(math.erfc), "lgamma": vec(math.lgamma),
    }  # fmt: skip
    return SimpleNamespace(**{k: wrap(f) for k, f in table.items()})


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors) in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def for_mode(interpret: bool) -> Any:
    """The libdevice a generated module binds: numpy's under the interpreter, Triton's
    otherwise (each made once)."""
    if interpret not in _MADE:
        if interpret:
            _MADE[interpret] = _interpreted()
        else:
            from triton.language.extra import libdevice as device

            _MADE[interpret] = device
    return _MADE[interpret]


_MADE: dict[bool, Any] = {}
