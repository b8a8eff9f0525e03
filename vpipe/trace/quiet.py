"""Keep torch.profiler's trace-point chatter off the terminal, and everything else on it.

Kineto (the profiler's C++ library) writes a line such as
``USDT:2026-01-01 12:00:00 1234:1234 SyncActivityProfilerHandler.cpp:52] profiler_start``
(older builds: ``STAGE:... Completed Stage: Warm Up``) straight to file descriptor 2 whenever a
trace window opens or closes: two per rank per profiled window, dozens in one ``vpipe bench``.
Redirecting ``sys.stderr`` does not catch C++ writes, so :func:`filtered_stderr` points fd 2 at a
temporary file around the profiler calls, then restores it and writes back every line that is
not such chatter: real errors and warnings still show, after the call instead of during it.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

# Kineto's log prefix: LEVEL:YYYY-MM-DD HH:MM:SS pid:tid File.cpp:line]
KINETO_CHATTER = re.compile(rb"(?:USDT|STAGE):\d{4}-\d\d-\d\d [^\n\]]*\.cpp:\d+\] ")


@contextmanager
def filtered_stderr(drop: re.Pattern[bytes] = KINETO_CHATTER) -> Iterator[None]:
    """Hold back what this process writes to fd 2 inside the block; afterwards write back the
    lines ``drop`` does not match (at their start). A process without fd 2 is left as it is."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with tempfile.TemporaryFile() as held:
            _flush_stderr()
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                _flush_stderr()
                os.dup2(saved, 2)
                held.seek(0)
                lines = held.read().splitlines(keepends=True)
                _write_all(2, b"".join(ln for ln in lines if not drop.match(ln)))
    finally:
        os.close(saved)


def _flush_stderr() -> None:
    if sys.stderr is not None:
        sys.stderr.flush()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
