"""Checks for settings: a misspelt environment variable or option value is an error that
lists the valid ones, never silently ignored (and never a compile that fails later and
falls back to torch)."""

from __future__ import annotations

import os
from collections.abc import Sequence

FLAGS = {"": False, "0": False, "false": False, "no": False, "off": False}
FLAGS |= {"1": True, "true": True, "yes": True, "on": True}


def check(what: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, allowed))}, not {value!r}")


def flag(name: str) -> bool:
    """An on/off environment variable (unset: off)."""
    value = os.environ.get(name, "").strip().lower()
    check(name, value, list(FLAGS))
    return FLAGS[value]


def names(name: str, allowed: Sequence[str]) -> list[str]:
    """A comma-separated list of names from `allowed` (unset: none)."""
    out = [w.strip() for w in os.environ.get(name, "").split(",") if w.strip()]
    for w in out:
        check(name, w, allowed)
    return out
