"""One compile's context: its options, and what each pass did and how long it took. Passes
record here; the report reads it. With Options.verify every rewritten graph is checked
(ir/verify.py), with Options.debug_dir written out as text after each pass."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .ir.graph import Graph
from .ir.printer import format_graph
from .ir.verify import verify
from .options import Options

if TYPE_CHECKING:
    from .rewrite.batchnorm import Fold, Refusal

log = logging.getLogger("opfuse.passes")

GraphPass = Callable[[Graph, "Context"], Graph]
_compiles = itertools.count()


@dataclass
class Context:
    options: Options = field(default_factory=Options)
    devices: tuple[str, ...] = ("cpu",)  # where the chosen backend's kernels run
    notes: dict[str, list[str]] = field(default_factory=dict)  # pass -> what it did
    seconds: dict[str, float] = field(default_factory=dict)  # pass or stage -> time
    folds: list[Fold] = field(default_factory=list)  # BatchNorms folded into convolutions
    refusals: list[Refusal] = field(default_factory=list)  # BatchNorms kept, and why
    layout: str = ""  # the activation layout chosen for convolutions, and why
    _dump: Path | None = None
    _step: int = 0

    def note(self, name: str, text: str) -> None:
        self.notes.setdefault(name, []).append(text)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.seconds[name] = self.seconds.get(name, 0.0) + dt
            log.debug("%s: %.1f ms", name, dt * 1e3)

    def run(self, p: GraphPass, graph: Graph) -> Graph:
        """Run one pass: timed, the result verified and dumped when asked."""
        name = p.__name__
        with self.timed(name):
            out = p(graph, self)
        self._step += 1
        if self.options.verify:
            verify(out, after=name)
        if self.options.debug_dir:
            self.dump(f"{self._step:02d}-{name}.txt", format_graph(out))
        return out

    def dump(self, filename: str, text: str) -> None:
        if self._dump is None:
            stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_compiles)}"
            self._dump = Path(self.options.debug_dir or ".") / f"passes-{stamp}"
            self._dump.mkdir(parents=True, exist_ok=True)
        (self._dump / filename).write_text(text)
