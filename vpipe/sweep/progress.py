"""A sweep's progress on rank 0: a rich bar on a terminal, plain timed lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """A rich progress bar on a terminal, plain lines otherwise (logs, CI, pytest)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._t0 = time.perf_counter()
        self._bar: Any = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description:<34}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
            )
            self._task = self._bar.add_task("starting", total=total)
            self._bar.start()

    def extend(self, units: int) -> None:
        """More units of work than planned (a round added while the sweep runs)."""
        self.total += units
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)

    def advance(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=what)
        else:
            print(
                f"[{self.done}/{self.total} {time.perf_counter() - self._t0:6.1f}s] {what}",
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
