"""The round gate of a paced launch: its timed rounds start one at a time, when the paced side
says so, so that ``vpipe ab`` can alternate two versions' rounds while both launches are open
(:mod:`vpipe.sweep.paced`). Rounds a fraction of a second apart see nearly the same host;
launches seconds apart do not (on a shared 2-core VM the host's speed wanders by several
percent over seconds, so whole launches compared in turn spread 8-11% per pair).

FIFOs in a directory carry it, one line at a time: the paced side writes ``round`` or
``stop`` into each rank's ``go<rank>``; rank 0 answers ``ready`` once every config is built
and warm, and ``done`` after each round (whose last collective all ranks have passed), into
``done``. Every rank waits for its word in a read of its own FIFO, which uses no CPU and has
no timeout, so the other version's rounds and warm-up may take as long as they take (a wait
in a collective would be bounded by the process group's timeout).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:  # the rank's timed rounds, imported where they run
    from vpipe.sweep.rounds import Rounds


class GateError(RuntimeError):
    """The launch on the other end of the gate failed or went away (its line says why)."""


class Gate:
    """The paced side's end: it opens both FIFOs read-write, so that neither open blocks and a
    line written before rank 0 opens its end waits in the pipe."""

    def __init__(self, directory: str | Path, ranks: int) -> None:
        self.path = Path(directory)
        names = [f"go{r}" for r in range(ranks)]
        for name in (*names, "done"):
            os.mkfifo(self.path / name)
        self._go = [os.fdopen(os.open(self.path / n, os.O_RDWR), "w", buffering=1) for n in names]
        self._done = os.fdopen(os.open(self.path / "done", os.O_RDWR), "r", buffering=1)
        self._own_done = os.fdopen(os.open(self.path / "done", os.O_WRONLY), "w", buffering=1)

    def wait(self) -> None:
        """The next line from rank 0 (``ready`` or ``done``); GateError with the line that
        came instead (:meth:`fail`)."""
        line = self._done.readline().strip()
        if line not in ("ready", "done"):
            raise GateError(line or "the launch went away")

    def _say(self, word: str) -> None:
        for go in self._go:
            go.write(word + "\n")

    def round(self) -> None:
        """Start one round and wait for its end."""
        self._say("round")
        self.wait()

    def stop(self) -> None:
        """No more rounds: the launch finishes (memory step, results)."""
        self._say("stop")

    def fail(self, why: str) -> None:
        """Wake a :meth:`wait` with ``why`` (the launch failed or was interrupted)."""
        self._own_done.write(why.replace("\n", " ") + "\n")

    def close(self) -> None:
        for f in (*self._go, self._done, self._own_done):
            f.close()


class RankGate:
    """A rank's end: each rank reads its own ``go<rank>``; rank 0 also writes ``done``."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        path = Path(directory)  # the paced side holds every FIFO open, so no open blocks
        self._go = open(path / f"go{rank}", encoding="utf-8")  # noqa: SIM115 - the launch's
        self._done: IO[str] | None = None
        if rank == 0:
            self._done = open(path / "done", "w", buffering=1, encoding="utf-8")  # noqa: SIM115

    def ready(self) -> None:
        if self._done is not None:
            self._done.write("ready\n")

    def next_round(self) -> bool:
        """Wait for the paced side: True for another round, False once it says stop (or has
        gone: the end of the FIFO)."""
        return self._go.readline().strip() == "round"

    def done(self) -> None:
        if self._done is not None:
            self._done.write("done\n")

    def close(self) -> None:
        for f in (self._go, self._done):
            if f is not None:
                f.close()


def gated_rounds(gate: RankGate, timed: Rounds, configs: list[int]) -> None:
    """The timed rounds of a gated launch: ready once warm, then one round each time the
    paced side says so, until it says stop."""
    try:
        gate.ready()
        r = 0
        while gate.next_round():
            timed.run(r, configs)
            gate.done()
            r += 1
    finally:
        gate.close()
