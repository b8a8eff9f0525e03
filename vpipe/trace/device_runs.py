"""Rows of a CUDA trace's rank that names no actions (torch's Schedule1F1B), from its device
ops: the GPU counterpart of the runs of operators on the CPU (:mod:`vpipe.trace.operators`).

Per profiled step, the compute-stream ops its action threads launched, in launch order, are
cut into runs where an NCCL kernel was launched between two of them (a message was posted)
and where the launching thread changes between the step's own thread and autograd's (a
forward and a backward): a run launched by autograd's thread is a ``B``, the rest ``F``
(microbatch -1, named ``ops``), from its first op's start to its last op's end, ``busy_ns``
the union of its ops. The gradient seed's fill, which the step's thread launches, stays with
the forward before it.

A run after posted messages may have waited for one of them: its ``WAIT(ops)`` row runs from
the later of the device's previous work end and the last NCCL launch before the run (where
the host asks for the data) to the end of the NCCL kernels launched since the previous run,
never past the run's first op. Which of those kernels were receives is not in the kernels'
names, so a send that ends after its receive, while the run waits for its launch, is counted
as waiting; a run whose first op starts when its data lands is read exactly.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from vpipe.trace.gpu_owners import merged_intervals
from vpipe.trace.operators import OPS_WAIT, RUN_NAME


def device_runs(
    steps: pd.DataFrame, ops: pd.DataFrame, step_tids: set[int], stream: int | None, rank: int
) -> pd.DataFrame:
    """Compute and WAIT rows (module docstring) of the ``steps`` rows (host ``start_ns`` /
    ``end_ns``, ``step``) from ``ops`` (:func:`device_clock.gpu_ops`' table, the action
    threads' ops only); ``step_tids`` the threads that hold the step spans, ``stream`` the
    compute stream."""
    rows: list[dict] = []
    launch = ops["launch_ns"].to_numpy()
    for s0, s1, k in zip(steps["start_ns"], steps["end_ns"], steps["step"], strict=True):
        mine = ops[(launch >= s0) & (launch <= s1)]
        work = ~mine["nccl"].to_numpy() & (mine["stream"].to_numpy() == stream)
        rows += _step_rows(mine[work | mine["nccl"].to_numpy()], step_tids, int(k))
    cols = ["kind", "name", "start_ns", "end_ns", "busy_ns", "launch_start_ns", "launch_end_ns"]
    out = pd.DataFrame(rows, columns=[*cols, "step"])
    return out.assign(stage=rank, microbatch=-1, clock="device")


def _step_rows(ops: pd.DataFrame, step_tids: set[int], step: int) -> list[dict]:
    """One step's rows from its ops (compute-stream work and NCCL kernels), in launch order."""
    rows: list[dict] = []
    run: list[tuple] = []  # (start, end, launch) of the current run's ops
    kind, posted = "", []  # the run's kind; NCCL kernels (launch, end) since the last run
    reach = -1  # the device's previous work end

    def close() -> None:
        nonlocal reach
        if not run:
            return
        s, e, ln = (np.array(c) for c in zip(*run, strict=True))
        m0, m1 = merged_intervals(s, e)
        rows.append({"kind": kind, "name": RUN_NAME, "start_ns": int(s.min()), "end_ns": int(e.max()),
                     "busy_ns": int((m1 - m0).sum()), "launch_start_ns": int(ln.min()),
                     "launch_end_ns": int(ln.max()), "step": step})  # fmt: skip
        reach = max(reach, int(e.max()))
        run.clear()

    for s, e, ln, nccl, tid in zip(ops["start_ns"], ops["end_ns"], ops["launch_ns"], ops["nccl"],
                                   ops["tid"], strict=True):  # fmt: skip
        if nccl:
            close()
            posted.append((int(ln), int(e)))
            continue
        this = "F" if int(tid) in step_tids else "B"
        if run and this != kind:
            close()
        if not run and posted:
            begin = min(max(reach, posted[-1][0]), int(s))
            stop = min(max(end for _, end in posted), int(s))
            if stop > begin:
                rows.append({"kind": "WAIT", "name": OPS_WAIT, "start_ns": begin, "end_ns": stop,
                             "busy_ns": stop - begin, "launch_start_ns": posted[-1][0],
                             "launch_end_ns": posted[-1][0], "step": step})  # fmt: skip
            posted = []
        kind = this
        run.append((int(s), int(e), int(ln)))
    close()
    return rows
