"""Actions for the runs of operators of ranks that name none (torch's Schedule1F1B), where the
runs follow a catalogue single-stage program (``1f1b``, else ``gpipe``) exactly.

A rank's runs (:mod:`vpipe.trace.operators`, :mod:`vpipe.trace.device_runs`) are cut at
communication calls and where backward starts or stops, so not every run starts an action:
torch's backward is followed by a few operators of its own (``detach_``) before the next
communication call, and the step holds work outside every action (splitting the batch before
the first one, scaling the gradients after the last). Walking a rank's runs of one step in
order against its stage's program (stage = rank), a run starts the program's next action when
it has that action's kind and either follows a communication call or the action receives
nothing (a forward of stage 0, a backward of the last stage: torch computes the loss inside
the last stage's forward run). Such a run becomes the action's row (``1F3``, its stage and
microbatch); the other runs keep their ``ops`` rows, so busy time and bubble do not change.
Runs before the first action and after the last are the step's own work; a run that follows a
communication call between two actions and starts none, or a rank that runs fewer actions, is
no match, and every row is left as it is.

M is each rank's number of backward runs (autograd's nodes run back to back, so a backward is
one run), which all ranks must agree on, unless it is given. The ``WAIT(ops)`` row before an
action's run names the receive it waited for (``WAIT(ops):1RECV_F3``), or the action where it
receives nothing (the wait was for a send to be posted or to finish).
"""

from __future__ import annotations

import pandas as pd

from vpipe.ir import Action, Schedule
from vpipe.schedules import make_schedule
from vpipe.trace.operators import AFTER_COMM, OPS_WAIT, RUN_NAME

FAMILIES = ("1f1b", "gpipe")  # the single-stage programs torch runs without action spans


def name_runs(
    events: pd.DataFrame, n_ranks: int, microbatches: int | None = None
) -> tuple[pd.DataFrame, str | None, str]:
    """``events`` with the operator runs of every rank named as the actions of the program
    they follow (module docstring) and that program (``1f1b at M=8``); or ``events`` as they
    are, None and why they follow none (``rank 1: 9 backward runs in step 2, 8 expected``)."""
    is_run = events["name"].astype(str) == RUN_NAME
    ranks = sorted(int(r) for r in events.loc[is_run, "rank"].unique())
    counts = {
        (r, int(k)): int((g["kind"] == "B").sum())
        for (r, k), g in events[is_run].groupby(["rank", "step"])
    }
    m = microbatches or (counts[min(counts)] if counts else 0)
    for (r, k), n in sorted(counts.items()):
        if n != m:
            return events, None, f"rank {r}: {n} backward runs in step {k}, {m} expected"
    if not m or not set(ranks) <= set(range(n_ranks)):
        return events, None, f"the runs are on ranks {ranks}, not on ranks of {n_ranks}"
    whys = []
    for fam in FAMILIES:
        named, why = _name_all(events, make_schedule(fam, n_ranks, m))
        if named is not None:
            return named, f"{fam} at M={m}", ""
        whys.append(why)
    return events, None, whys[0]  # where the runs leave the first program (1f1b)


def _name_all(events: pd.DataFrame, program: Schedule) -> tuple[pd.DataFrame | None, str]:
    """``events`` named by ``program``, or None and the first rank and step that differ."""
    rows: dict[object, list] = {}  # row label -> its kind, stage, microbatch and name
    for (r, k), g in events.groupby(["rank", "step"]):
        runs = g[g["name"].astype(str).isin([RUN_NAME, OPS_WAIT])].sort_values("start_ns")
        if runs.empty:
            continue
        starts = _starts(runs, program, int(r))
        if starts is None:
            return None, f"rank {r}: step {k}'s runs are not {program.name}'s order"
        for label, a in starts.items():
            rows[label] = [a.kind.value, a.stage, a.microbatch, str(a)]
        for label, a in _waits(runs, starts):
            rows[label] = ["WAIT", a.stage, a.microbatch, _wait_name(a, program.n_stages)]
    out = events.copy()
    cols = ["kind", "stage", "microbatch", "name"]
    if rows:
        out.loc[list(rows), cols] = pd.DataFrame(
            list(rows.values()), index=list(rows), columns=cols
        )
    return out, ""


def _starts(runs: pd.DataFrame, program: Schedule, rank: int) -> dict[object, Action] | None:
    """{row label: action} of the run that starts each action of ``rank``'s program in one
    step's rows (WAIT rows skipped), or None where the runs do not follow it. Where several
    choices fit, a run starts an action as early as it can."""
    todo, last = list(program.actions[rank]), program.n_stages - 1
    runs = runs[runs["kind"] != "WAIT"]
    kinds, after = list(runs["kind"]), [bool(a) for a in runs[AFTER_COMM]]
    n, n_act = len(kinds), len(todo)

    def starts(i: int, j: int) -> bool:  # run i can start action j
        a = todo[j]
        receives = a.stage > 0 if a.kind.value == "F" else a.stage < last
        return kinds[i] == a.kind.value and (after[i] or not receives)

    # fits[i][j]: runs i.. can follow the program once j actions have started
    fits = [[False] * (n_act + 1) for _ in range(n + 1)]
    fits[n][n_act] = True
    for i in range(n - 1, -1, -1):
        for j in range(n_act + 1):
            outside = j in (0, n_act) or not after[i]  # before, after, or inside an action
            fits[i][j] = (j < n_act and starts(i, j) and fits[i + 1][j + 1]) or (
                outside and fits[i + 1][j]
            )
    if not fits[0][0]:
        return None
    out: dict[object, Action] = {}
    for i, label in enumerate(runs.index):
        j = len(out)
        if j < n_act and starts(i, j) and fits[i + 1][j + 1]:
            out[label] = todo[j]
    return out


def _waits(runs: pd.DataFrame, starts: dict[object, Action]) -> list[tuple[object, Action]]:
    """(WAIT row label, the action whose run follows it) for the step's waits before actions."""
    out, pending = [], None
    for label, kind in zip(runs.index, runs["kind"], strict=True):
        if kind == "WAIT":
            pending = label
            continue
        if pending is not None and label in starts:
            out.append((pending, starts[label]))
        pending = None
    return out


def _wait_name(action: Action, n_stages: int) -> str:
    """``WAIT(ops):{receive}`` for an action that receives, else ``WAIT(ops):{action}``."""
    kind, stage, mb = action.kind.value, action.stage, action.microbatch
    if kind == "F" and stage > 0:
        return f"{OPS_WAIT}:{stage}RECV_F{mb}"
    if kind == "B" and stage < n_stages - 1:
        return f"{OPS_WAIT}:{stage}RECV_B{mb}"
    return f"{OPS_WAIT}:{action}"
