"""CPU time of a rank's communication threads, from /proc, and whether it comes out of compute.

A rank's messages are moved by threads beside the one that computes: gloo's I/O loop, torch's
process-group threads and vpipe's poster (:mod:`vpipe.runtime.comm`). On a host whose cores
are all taken by compute threads (2 ranks of one thread on 2 cores), every millisecond they run
is a millisecond a compute thread is descheduled, and it shows up inside the compute spans
(docs/runtime.md, "Communication threads"). A schedule with more messages then computes more
slowly, which per-action costs calibrated on another schedule cannot know.

:func:`comm_thread_ns` sums the run time (``/proc/self/task/<tid>/schedstat``, nanoseconds) of
those threads, found by name (``gloo*``, ``pt_*``) and, for the poster, by its thread id.
:func:`cores_shared` says whether the host's cores are all taken by compute. Parsing is pure
(text in, numbers out) and tested on made-up contents. Importing this module does not import
torch.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["COMM_THREAD_PREFIXES", "comm_thread_ns", "cores_shared", "parse_schedstat"]

# Thread names (/proc/.../comm) of torch.distributed's own threads: gloo's I/O loop
# (gloo_tcp_loop), its process-group work loop (pt_gloo_runloop), the store's (pt_tcpstore_uv)
COMM_THREAD_PREFIXES = ("gloo", "pt_")


def parse_schedstat(text: str) -> int:
    """Nanoseconds a thread ran on a CPU: the first field of its ``schedstat``."""
    return int(text.split()[0])


def comm_thread_ns(extra_tids: tuple[int, ...] = (), task_dir: str = "/proc/self/task") -> int | None:
    """CPU nanoseconds this process's communication threads have run so far: those whose name
    starts with :data:`COMM_THREAD_PREFIXES`, and ``extra_tids`` (vpipe's poster); None where
    /proc has no such directory (not Linux)."""
    root = Path(task_dir)
    if not root.is_dir():
        return None
    total = 0
    for task in root.iterdir():
        try:
            name = (task / "comm").read_text().strip()
            if name.startswith(COMM_THREAD_PREFIXES) or int(task.name) in extra_tids:
                total += parse_schedstat((task / "schedstat").read_text())
        except (OSError, ValueError):  # the thread ended between listing and reading
            continue
    return total


def cores_shared(compute_threads: int) -> bool:
    """Whether ``compute_threads`` (the host's ranks x each rank's torch threads) take every
    core this process may run on, so that other threads' CPU time comes out of theirs."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return compute_threads >= cores
