"""A progress bar for long compiles (many kernels to time), on a terminal only."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from ..settings import flag


class Progress:
    """`with Progress(total, "timing implementations") as p: ... p.update()`. Draws on
    stderr when it is a terminal and the work takes a while; otherwise does nothing."""

    DELAY = 0.5  # seconds before the bar appears: short compiles stay quiet

    def __init__(self, total: int, what: str) -> None:
        self.total, self.what, self.done = total, what, 0
        self.start = time.perf_counter()
        # (the setting checked first: a misspelt value is an error on any terminal)
        self.enabled = not flag("OPFUSE_NO_PROGRESS") and total > 1 and sys.stderr.isatty()
        self.drawn = False

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.enabled and time.perf_counter() - self.start > self.DELAY:
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            sys.stderr.write(f"\ropfuse: {self.what} [{bar}] {self.done}/{self.total}")
            sys.stderr.flush()
            self.drawn = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
