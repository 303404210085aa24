"""The tuner's memory: decisions stored in the kernel cache directory, keyed by everything
that could change them (the candidates' code, shapes, thread count, CPU, torch version), so
a warm compile does not time again. A damaged file costs a re-measurement, never a compile."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .lower.groups import IMPLEMENTATIONS

# Part of every decision's key: a change to how candidates are timed or run (the estimator,
# an in-place variant) makes decisions remembered under the old rules stale.
TUNER_VERSION = "12"
# Candidates that write the library's result to memory and read it back for the epilogue.
# Timed alone, their intermediate stays in cache between the two kernels; inside a model it
# evicts the data the next groups read, so they win only by a margin (ResNet-50 batch 8:
# five 3x3 convolutions + ReLU timed 1-5% faster unfused, yet the model ran 6.5% faster
# with every group fused). Every "*unfused" candidate is one (a library call, then the
# epilogue kernel), so none can be left off the list.
MATERIALISING = frozenset(n for n in IMPLEMENTATIONS if n.endswith("unfused"))
FUSED_MARGIN = 1.10
# torch's convolution reorders its plain weight into oneDNN's blocked layout on every call;
# timed alone the reorder reads a weight that stays in cache. ResNet-50 batch 8 in a model
# profile: the downsample convolutions torch's call won alone by 0.1% ran 6.07 and 10.49 ms
# against 5.69 and 8.98 (the latter with an add fused) with prepacked weights. A lone
# convolution's torch call must win by the same margin.
REORDERING = frozenset({"torch"})


@dataclass(frozen=True)
class Decision:
    choice: str
    seconds: dict[str, float]  # fastest sample of each candidate that ran
    cached: bool = False

    def describe(self) -> str:
        if not self.seconds:
            return f"{self.choice} (forced by Options.implementation)"
        ranked = sorted(self.seconds.items(), key=lambda kv: kv[1])
        times = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in ranked)
        src = "cached decision" if self.cached else "measured"
        why = ""
        if self.choice != ranked[0][0] and ranked[0][0] in MATERIALISING:
            why = f"; fused kept: within {FUSED_MARGIN - 1:.0%} of the unfused call"
        elif self.choice != ranked[0][0] and ranked[0][0] in REORDERING:
            why = (
                f"; prepacked weight kept: within {FUSED_MARGIN - 1:.0%} of torch's call, "
                "which reorders its weight on every call"
            )
        return f"{self.choice} ({src}: {times}{why})"


def decision_key(parts: Sequence[str]) -> str:
    h = hashlib.sha256()
    machine = (torch.__version__, platform.machine(), _cpu(), str(torch.get_num_threads()))
    for p in (*parts, *machine, TUNER_VERSION):
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _store() -> Path | None:
    try:
        from .backends.base import cache_dir

        return cache_dir() / "decisions.json"
    except Exception:
        return None


def load_decision(key: str) -> Decision | None:
    path = _store()
    if path is None:
        return None
    d = _read_store(path, copy=False).get(key)
    return Decision(d["choice"], d["seconds"], cached=True) if d else None


def save_decision(key: str, d: Decision) -> None:
    path = _store()
    if path is None:
        return
    data = _read_store(path)  # bad entries are not written back
    data[key] = {"choice": d.choice, "seconds": d.seconds}
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # concurrent writers: last one wins, the file stays valid
    except OSError as e:  # the decision is only not remembered
        _warn_store_once(path, f"cannot be written ({e}): decisions are not remembered")


# The parsed file by path, with the (inode, size, mtime) it was read at: a compile looks up
# a decision per tuned group, and parsing and checking a file of a few thousand entries each
# time took most of a warm compile's tuning (BERT-base: 144 lookups, 0.3-0.7 s).
_parsed: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}


def _read_store(path: Path, copy: bool = True) -> dict[str, Any]:
    """The valid entries of the decisions file (a copy unless `copy` is False: then
    read-only). A file that is no JSON object, and entries of another shape, are ignored
    with one warning and left out of the next save: a damaged file must not stop tuning
    (or compiling) for good."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    except OSError:
        st = None
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns) if st is not None else None
    hit = _parsed.get(str(path))
    if hit is not None and stamp is not None and hit[0] == stamp:
        return dict(hit[1]) if copy else hit[1]
    good = _parse_store(path)
    if stamp is not None:
        _parsed[str(path)] = (stamp, good)
    return dict(good) if copy else good


def _parse_store(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn_store_once(path, f"is not readable JSON ({type(e).__name__}){_REDO}")
        return {}
    if not isinstance(data, dict):
        _warn_store_once(path, f"holds a {type(data).__name__}, not an object{_REDO}")
        return {}
    good = {k: v for k, v in data.items() if _valid_entry(v)}
    if len(good) != len(data):
        _warn_store_once(path, f"has {len(data) - len(good)} malformed entries{_REDO}")
    return good


def _valid_entry(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and isinstance(v.get("choice"), str)
        and isinstance(v.get("seconds"), dict)
        and all(
            isinstance(k, str) and isinstance(t, (int, float)) and not isinstance(t, bool)
            for k, t in v["seconds"].items()
        )
    )


_REDO = ": ignored, the tuner measures again and rewrites it"
_store_warned: set[str] = set()


def _warn_store_once(path: Path, what: str) -> None:
    if str(path) not in _store_warned:
        _store_warned.add(str(path))
        warnings.warn(
            f"opfuse: the decision cache {path} {what}",
            RuntimeWarning,
            stacklevel=3,
        )
