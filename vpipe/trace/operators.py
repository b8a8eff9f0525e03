"""What a rank computed, read from its CPU operators, for traces whose runtime does not mark
its waits (torch.distributed.pipelining on CPU).

torch's runtime posts a receive in a RECV action and waits for it at the start of the
consuming F/I/B, inside that action's ``PP:`` span; nothing in the trace marks the wait except
that no operator runs. So, on a rank's thread:

- A compute row (a ``PP:`` action, or torch's ``Forward i`` / ``Backward i``) runs from its
  first operator to the end of its last one, communication calls (``c10d::``, ``gloo:``,
  ``nccl``, ``record_param_comms``) left out: the time before the first operator is a WAIT row
  named ``WAIT(ops):{the receive it waited for}`` (``1RECV_F3`` before ``1F3``: found from the
  operators, not a span of the trace; a W's or an overlap's names its action), the time
  after the last one (posting a send, the interpreter leaving the span) is neither. ``busy_ns``
  is the union of its operators; the bubble counts the row's extent, which also holds the
  interpreter's time between operators.
- A rank that names no actions (torch's Schedule1F1B) gets one row per run of operators
  between two communication calls, split where autograd's backward nodes start or stop: ``B``
  for backward runs, ``F`` for the rest, microbatch -1, named ``ops`` (a run split off so
  starts where the one before it ended: the time between them is the interpreter's, counted
  as within a run); the time between two runs that holds a communication call is a
  ``WAIT(ops)`` row (each run says in ``AFTER_COMM`` whether a communication call came before
  it). Busy time, waits and bubble per rank are right; the runs are named as actions where
  they follow a catalogue program (:mod:`vpipe.trace.run_actions`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from vpipe.events import COMPUTE_KINDS
from vpipe.trace.gpu_owners import union_length

OPS_WAIT = "WAIT(ops)"  # the name prefix of a wait found from the operators
RUN_NAME = "ops"  # a compute row that is a run of operators, not an action
AFTER_COMM = "after_comm"  # a run's column: a communication call came before it in its step


def no_actions_note(ranks: list[int], follows: str | None, why: str = "") -> str:
    """The line saying what a trace whose ``ranks`` name no actions tells: the program their
    runs of operators ``follow`` (:mod:`vpipe.trace.run_actions`), else ``why`` they follow
    none and what is then lost."""
    who = f"rank {ranks[0]} names" if len(ranks) == 1 else f"ranks {ranks} name"
    head = f"{who} no actions (e.g. torch's Schedule1F1B): "
    if follows:
        return head + f"their runs of operators follow {follows} and are named as its actions"
    return head + (
        "busy time, waits and bubble come from runs of operators between communication calls; "
        f"microbatches, the schedule and per-action costs are not recoverable ({why})"
    )


def _ops_ns(ops: Mapping[str, np.ndarray], base: int, tid: int) -> tuple[np.ndarray, ...]:
    """(start, end, comm, backward) of the operators of thread ``tid``, sorted by start."""
    on = ops["tid"] == tid
    start = base + np.rint(ops["ts"][on] * 1000.0).astype(np.int64)
    end = start + np.rint(ops["dur"][on] * 1000.0).astype(np.int64)
    order = np.argsort(start, kind="stable")
    return start[order], end[order], ops["comm"][on][order], ops["backward"][on][order]


def read_by_operators(
    df: pd.DataFrame, ops: Mapping[str, np.ndarray], base: int, rank: int
) -> tuple[pd.DataFrame, bool]:
    """``df`` (one file's rows on the host clock, with ``tid``) with its compute rows read
    from the operators, WAIT rows added and ``busy_ns`` set; and whether the rank names its
    actions (else its rows are operator runs)."""
    compute = df["kind"].isin(COMPUTE_KINDS).to_numpy()
    df = df.assign(busy_ns=df["end_ns"] - df["start_ns"])
    if not compute.any():
        steps = df[(df["kind"] == "other") & (df["name"] == "STEP")]
        if steps.empty or not len(ops["ts"]):
            return df, True
        runs = [_runs(step, ops, base, rank) for _, step in steps.iterrows()]
        return pd.concat([df, *runs], ignore_index=True), False
    rows = np.flatnonzero(compute)
    s_all, e_all = df["start_ns"].to_numpy().copy(), df["end_ns"].to_numpy().copy()
    busy, tids = df["busy_ns"].to_numpy().copy(), df["tid"].to_numpy()
    lead = np.zeros(len(df), np.int64)  # wait before the first operator, per compute row
    for tid in np.unique(tids[rows]):
        start, end, comm, _ = _ops_ns(ops, base, int(tid))
        start, end = start[~comm], end[~comm]
        mine = rows[tids[rows] == tid]
        lo = np.searchsorted(start, s_all[mine], "left")
        hi = np.searchsorted(start, e_all[mine], "left")
        for at, i, j in zip(mine, lo, hi, strict=True):
            s, e = s_all[at], e_all[at]
            if i == j:  # no operator ran: the whole span waited
                lead[at], s_all[at], busy[at] = e - s, e, 0
                continue
            oe = np.minimum(end[i:j], e)
            lead[at] = start[i] - s
            s_all[at], e_all[at], busy[at] = start[i], oe.max(), union_length(start[i:j], oe)
    waits = df.iloc[rows[lead[rows] > 0]]
    w_end = s_all[rows[lead[rows] > 0]]
    df = df.assign(start_ns=s_all, end_ns=e_all, busy_ns=busy)
    if waits.empty:
        return df, True
    what = waits[["kind", "stage", "microbatch", "name"]].itertuples(index=False)
    waits = waits.assign(
        kind="WAIT",
        name=[wait_name(*w) for w in what],
        end_ns=w_end,
        busy_ns=w_end - waits["start_ns"].to_numpy(),
    )
    # an overlap action's parts share one span: one WAIT row for it
    waits = waits.drop_duplicates(["start_ns", "end_ns", "tid"])
    return pd.concat([df, waits], ignore_index=True), True


def wait_name(kind: str, stage: int, microbatch: int, name: str) -> str:
    """A found wait's name: the receive its action waits for, as vpipe's runtime names its
    waits (``WAIT(ops):1RECV_F3`` before ``1F3``, ``RECV_B`` before an I or B); an overlap
    action's, or a W's (which receives nothing), names the action."""
    recv = {"F": "RECV_F", "I": "RECV_B", "B": "RECV_B"}.get(kind)
    if recv is None or name.startswith("("):
        return f"{OPS_WAIT}:{name}"
    return f"{OPS_WAIT}:{stage}{recv}{microbatch}"


def _runs(step: pd.Series, ops: Mapping[str, np.ndarray], base: int, rank: int) -> pd.DataFrame:
    """Compute and WAIT rows of one step of a rank that names no actions."""
    start, end, comm, backward = _ops_ns(ops, base, int(step["tid"]))
    s0, s1 = int(step["start_ns"]), int(step["end_ns"])
    inside = (start >= s0) & (start < s1)
    start, end, comm, backward = start[inside], end[inside], comm[inside], backward[inside]
    top = np.concatenate(([True], start[1:] >= np.maximum.accumulate(end)[:-1]))
    start, end, comm, backward = start[top], end[top], comm[top], backward[top]
    rows: list[dict] = []
    i, n = 0, len(start)
    while i < n:
        if comm[i]:
            i += 1
            continue
        j = i
        while j + 1 < n and not comm[j + 1] and backward[j + 1] == backward[i]:
            j += 1
        kind, after = "B" if backward[i] else "F", bool(i and comm[i - 1])
        # cut where backward starts or stops, not at a communication call: the time between
        # the two runs is the interpreter's, as between two operators of one run
        s0 = int(start[i]) if after or not rows else rows[-1]["end_ns"]
        rows.append({"kind": kind, "name": RUN_NAME, "start_ns": s0, "end_ns": int(end[j]),
                     "busy_ns": union_length(start[i : j + 1], end[i : j + 1]),
                     AFTER_COMM: after})  # fmt: skip
        i = j + 1
    out = []
    for k, r in enumerate(rows):
        if k and r[AFTER_COMM] and r["start_ns"] > rows[k - 1]["end_ns"]:
            t0 = rows[k - 1]["end_ns"]
            out.append({"kind": "WAIT", "name": OPS_WAIT, "start_ns": t0,
                        "end_ns": r["start_ns"], "busy_ns": r["start_ns"] - t0, AFTER_COMM: False})  # fmt: skip
        out.append(r)
    frame = pd.DataFrame(out, columns=["kind", "name", "start_ns", "end_ns", "busy_ns", AFTER_COMM])
    return frame.assign(stage=rank, microbatch=-1, step=int(step["step"]), tid=int(step["tid"]))
