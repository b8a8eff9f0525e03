"""The round gate of a paced launch: its timed rounds start one at a time, when the paced side
says so, so that ``vpipe ab`` can alternate two versions' rounds while both launches are open
(:mod:`vpipe.sweep.paced`). Rounds a fraction of a second apart see nearly the same host;
launches seconds apart do not (on a shared 2-core VM the host's speed wanders by several
percent over seconds, so whole launches compared in turn spread 8-11% per pair).

Two FIFOs in a directory carry it, one line each way: the paced side writes ``round`` or
``stop`` into ``go``; rank 0 answers ``ready`` once every config is built and warm, and
``done`` after each round, into ``done``. Rank 0 passes each ``go`` on to the other ranks
with a broadcast, so they wait in the collective while the other version runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO


class GateError(RuntimeError):
    """The launch on the other end of the gate failed or went away (its line says why)."""


class Gate:
    """The paced side's end: it opens both FIFOs read-write, so that neither open blocks and a
    line written before rank 0 opens its end waits in the pipe."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory)
        for name in ("go", "done"):
            os.mkfifo(self.path / name)
        self._go = os.fdopen(os.open(self.path / "go", os.O_RDWR), "w", buffering=1)
        self._done = os.fdopen(os.open(self.path / "done", os.O_RDWR), "r", buffering=1)
        self._own_done = os.fdopen(os.open(self.path / "done", os.O_WRONLY), "w", buffering=1)

    def wait(self) -> None:
        """The next line from rank 0 (``ready`` or ``done``); GateError with the line that
        came instead (:meth:`fail`)."""
        line = self._done.readline().strip()
        if line not in ("ready", "done"):
            raise GateError(line or "the launch went away")

    def round(self) -> None:
        """Start one round and wait for its end."""
        self._go.write("round\n")
        self.wait()

    def stop(self) -> None:
        """No more rounds: the launch finishes (memory step, results)."""
        self._go.write("stop\n")

    def fail(self, why: str) -> None:
        """Wake a :meth:`wait` with ``why`` (the launch failed or was interrupted)."""
        self._own_done.write(why.replace("\n", " ") + "\n")

    def close(self) -> None:
        for f in (self._go, self._done, self._own_done):
            f.close()


class RankGate:
    """A rank's end: rank 0 reads ``go`` and writes ``done``; every rank learns from rank 0's
    broadcast whether another round follows."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        self.rank = rank
        self._go: IO[str] | None = None
        self._done: IO[str] | None = None
        if rank == 0:  # the paced side holds both FIFOs open, so neither open blocks
            path = Path(directory)
            self._go = open(path / "go", encoding="utf-8")  # noqa: SIM115 - held for the launch
            self._done = open(path / "done", "w", buffering=1, encoding="utf-8")  # noqa: SIM115

    def ready(self) -> None:
        if self._done is not None:
            self._done.write("ready\n")

    def next_round(self) -> bool:
        """Wait for the paced side: True for another round, False once it says stop."""
        import torch
        import torch.distributed as dist

        go = torch.zeros(1, dtype=torch.int64)
        if self._go is not None:
            go[0] = int(self._go.readline().strip() == "round")
        dist.broadcast(go, src=0)
        return bool(go.item())

    def done(self) -> None:
        if self._done is not None:
            self._done.write("done\n")

    def close(self) -> None:
        for f in (self._go, self._done):
            if f is not None:
                f.close()
