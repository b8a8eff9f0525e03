"""Leave-one-out fidelity: calibrate on each measured config of a sweep in turn and predict
every other one against its timed median (the report's fidelity tables, the plan's stated
error, ``bench.fidelity_matrix``).

Each calibration (:func:`vpipe.predict.calibrate.calibrate`) takes its config's
communication-thread cost where the sweep measured it
(:func:`vpipe.predict.calibrate.with_comm_threads`) and is anchored to its timed median
(:func:`vpipe.predict.calibrate.anchor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from vpipe.events import COMPUTE_KINDS
from vpipe.predict.calibrate import (
    anchor,
    calibrate,
    comm_thread_cpu_s,
    fidelity_table,
    judged_against,
    model_units,
    with_comm_threads,
)
from vpipe.predict.split_cost import split_backward_ratio

__all__ = ["Case", "leave_one_out", "leave_one_out_tables"]


@dataclass
class Case:
    """One measured config for :func:`leave_one_out`: its schedule, its profiled events (to
    calibrate on) and its timed median step time in seconds (to judge predictions against)."""

    label: str
    schedule: Any
    events: pd.DataFrame
    timed_s: float
    comm_thread_cpu_s: float | None = None  # its communication threads' CPU s per step
    split_ratio: float | None = None  # its split probe (vpipe.predict.split_cost)


def leave_one_out(
    cases: list[Case], n_units: int | None = None, *, anchored: bool = True
) -> pd.DataFrame:
    """Calibrate on each case in turn and predict every case (itself included: the in-sample
    error); one row per calibration case, one column per predicted case, holding the relative
    error predicted / timed median - 1 (:func:`fidelity_table`'s ``error``). Each calibration
    uses the per-action medians over all of that case's profiled steps, anchored to that
    case's timed median (:func:`anchor`: the diagonal is then 0 by construction), unless
    ``anchored`` is False (the profiled steps' own level)."""
    targets = [(c.label, c.schedule, None, c.timed_s) for c in cases]
    rows = []
    for source in cases:
        cal = calibrate(source.events, split_ratio=source.split_ratio)
        threads = source.comm_thread_cpu_s
        if anchored:
            cal = anchor(cal, source.schedule, source.timed_s, n_units, comm_thread_cpu_s=threads)
        else:
            cal = with_comm_threads(cal, source.schedule, threads)
        t = fidelity_table(cal, targets, n_units)
        rows.append(
            {"calibrated on": source.label, **dict(zip(t["schedule"], t["error"], strict=True))}
        )
    return pd.DataFrame(rows)


def leave_one_out_tables(
    runs: pd.DataFrame, events_of: Any, ranks: int, meta: dict[str, Any]
) -> list[tuple[str, int, pd.DataFrame]]:
    """:func:`leave_one_out` per implementation and microbatch count of a sweep's measured
    ``runs`` (two profiled configs at least): ``(impl, M, table)``. ``events_of(run_id)`` gives
    a run's events (or None); ``meta`` names the model and its sizes, for the pieces. Cases
    follow the catalogue's display order."""
    from vpipe.schedules import catalogue, make_schedule

    order = {name: i for i, name in enumerate(catalogue.names())}
    out = []
    for (impl, m), group in runs.groupby(["impl", "microbatches"], sort=True):
        cases = []
        for r in sorted(group.itertuples(), key=lambda r: order.get(r.schedule, len(order))):
            ev = events_of(r.run_id)
            if ev is not None and ev["kind"].astype(str).isin(COMPUTE_KINDS).any():
                schedule = make_schedule(r.schedule, ranks, int(m))
                threads, split = comm_thread_cpu_s(r), split_backward_ratio(r)
                cases.append(Case(r.schedule, schedule, ev, judged_against(r), threads, split))
        if len(cases) >= 2:
            stages = max(c.schedule.n_stages for c in cases)
            units = model_units({**meta, "stages": stages})
            out.append((str(impl), int(m), leave_one_out(cases, units)))
    return out
