"""Enum members that are their names as text (Python 3.10 has no enum.StrEnum)."""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """A str-valued enum that prints, formats and compares as its value: reports and JSON
    keep the plain names."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
