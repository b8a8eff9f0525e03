"""The communication threads' CPU time as a cost of each posted message.

On a host whose cores are all taken by compute threads, gloo's I/O loop, torch's process-group
threads and vpipe's poster run on compute's time (:mod:`vpipe.trace.thread_cpu`). A sweep
records, per config, their CPU seconds per timed step summed over the ranks (the runs table's
``comm_thread_cpu_s``). :func:`with_comm_threads` turns that into a cost per posted operation
(:func:`vpipe.sim.posts.posted_operations`), which the cost model charges with ``post``, so
a schedule that sends more messages than the calibration run pays for them.

The calibration run's own share is already inside its compute spans; the anchor
(:func:`vpipe.predict.calibrate.anchor`), applied after this, scales compute so that the run
itself still simulates to its timed median, which takes that share back out. A run without
the figure (a GPU, a host with cores to spare, a trace) is left as it is.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vpipe.predict.calibrate import Calibration

__all__ = ["comm_thread_cpu_s", "with_comm_threads"]


def comm_thread_cpu_s(row: Any) -> float | None:
    """A run's communication threads' CPU seconds per step (its runs-table row or metadata), or
    None where they were not measured."""
    get = row.get if hasattr(row, "get") else lambda k: getattr(row, k, None)
    value = get("comm_thread_cpu_s")
    try:
        value = float(value)
    except (TypeError, ValueError):  # None, NA
        return None
    return value if value == value and value >= 0 else None


def with_comm_threads(
    cal: Calibration, schedule: Any, cpu_s_per_step: float | None, *, recv_lookahead: int = 1
) -> Calibration:
    """``cal`` with the communication threads' cost per posted operation (microseconds), from
    the CPU seconds per step its own run's ``schedule`` spent in them; unchanged without the
    figure or messages."""
    from vpipe.sim.posts import posted_operations

    if cpu_s_per_step is None:
        return cal
    posts = posted_operations(schedule, recv_lookahead)
    return replace(cal, comm_threads=cpu_s_per_step * 1e6 / posts) if posts else cal
