"""The CPU's cache sizes, from sysfs: what the tiling and the tuner size their working
sets by."""

from __future__ import annotations

import functools
from pathlib import Path

_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")


@functools.lru_cache(maxsize=1)
def _levels() -> dict[int, int]:
    """Bytes of each data (or unified) cache level cpu0 sees, by level."""
    sizes: dict[int, int] = {}
    for d in _SYSFS.glob("index*"):
        try:
            level = int((d / "level").read_text())
            kind = (d / "type").read_text().strip()
            text = (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if kind != "Instruction" and digits.isdigit():
            sizes[level] = max(sizes.get(level, 0), int(digits) * unit)
    return sizes


def last_level_bytes() -> int:
    """The last-level cache's size (32 MiB where the system does not say)."""
    levels = _levels()
    return levels[max(levels)] if levels else 32 << 20


def l2_bytes() -> int:
    """One core's level-2 cache (1 MiB where the system does not say)."""
    return _levels().get(2, 1 << 20)


def l1_bytes() -> int:
    """One core's level-1 data cache (32 KiB where the system does not say)."""
    return _levels().get(1, 32 << 10)
