"""The errors a plan's predictions carry, measured on the sweep its costs were calibrated in.

A plan calibrated on one config of a sweep predicts two kinds of candidate: at a microbatch
count the sweep measured (its error: the config's row of the leave-one-out table at that M,
:func:`vpipe.predict.fidelity.held_out_error`) and at one it did not (extrapolated: its error
is measured only when the sweep ran two or more M, by calibrating at one M and predicting
the configs timed at the others, :func:`across_m_table`). :func:`store_errors` finds the sweep
of a stored run and measures both, for ``vpipe plan --from`` and ``vpipe analyze --predict``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas is imported where a table is built: plan --cost needs none
    import pandas as pd

from vpipe.predict.fidelity import MeasuredError, held_out_error, unknown

__all__ = ["PlanErrors", "across_m_table", "plan_errors", "store_errors"]


@dataclass(frozen=True)
class PlanErrors:
    """The errors of predictions calibrated on one config: at the microbatch counts the sweep
    measured (``measured_m``) and at any other (``extrapolated``: never narrower)."""

    measured: MeasuredError
    extrapolated: MeasuredError
    measured_m: tuple[int, ...] = field(default_factory=tuple)


def label(schedule: str, m: int) -> str:
    """A config of an across-M table: ``zbv M=6``."""
    return f"{schedule} M={m}"


def across_m_table(
    runs: pd.DataFrame, events_of: Any, ranks: int, meta: dict[str, Any], sources: list[Any]
) -> pd.DataFrame | None:
    """Calibrate on each of ``sources`` (rows of ``runs``, all of one implementation) at its
    M and predict every config of ``runs`` timed at another M (compute and activations scaled
    to that M's rows, as the plan scales them): one row per source (``calibrated on``), one
    column per predicted config (``zbv M=12``), holding predicted / timed median - 1. None
    when ``runs`` has one M only."""
    import pandas as pd

    from vpipe.errors import ScheduleError
    from vpipe.predict.calibrate import comm_thread_cpu_s, judged_against
    from vpipe.predict.plan import calibrated_costs
    from vpipe.predict.split_cost import split_backward_ratio
    from vpipe.schedules import make_schedule
    from vpipe.sim import simulate

    if runs["microbatches"].nunique() < 2:
        return None
    batch = int(meta["batch"]) // max(1, int(meta.get("dp") or 1))
    rows = []
    for src in sources:
        events = events_of(src.run_id)
        own = make_schedule(src.schedule, ranks, int(src.microbatches))
        src_meta = {**meta, "stages": own.n_stages, "comm_thread_cpu_s": comm_thread_cpu_s(src),
                    "split_backward_ratio": split_backward_ratio(src)}  # fmt: skip
        costs = calibrated_costs(events, {}, own, src_meta, judged_against(src))
        row: dict[str, Any] = {"calibrated on": label(src.schedule, int(src.microbatches))}
        for t in runs[runs["microbatches"] != src.microbatches].itertuples():
            m = int(t.microbatches)
            try:
                schedule = make_schedule(t.schedule, ranks, m)
                cm = costs.cost_model(schedule, batch / m)
            except ScheduleError:
                continue  # the calibration's model cannot split for this config
            predicted_s = simulate(schedule, cm).makespan * 1e-6
            row[label(t.schedule, m)] = predicted_s / judged_against(t) - 1
        rows.append(row)
    return pd.DataFrame(rows)


def plan_errors(
    runs: pd.DataFrame,
    events_of: Any,
    base: Any,
    ranks: int,
    meta: dict[str, Any],
    loo: pd.DataFrame | None = None,
) -> PlanErrors:
    """The errors of predictions calibrated on ``base`` (a row of ``runs``: the measured,
    profiled configs of one sweep and implementation). ``loo``: the sweep's leave-one-out
    table at ``base``'s M when already made (else made here)."""
    from vpipe.predict.leave_one_out import leave_one_out_tables

    m = int(base.microbatches)
    same = runs[runs["microbatches"] == m]
    where = f"{base.impl} M={m}, calibrated on {base.schedule}"
    if loo is None and len(same) >= 2:
        found = leave_one_out_tables(same, events_of, ranks, meta)
        loo = found[0][2] if found else None
    measured = held_out_error(loo, base.schedule, where)
    swept = tuple(sorted(int(x) for x in runs["microbatches"].unique()))
    if len(swept) < 2:
        return PlanErrors(measured, unknown(_only(swept)), swept)
    across = held_out_error(
        across_m_table(runs, events_of, ranks, meta, [base]), label(base.schedule, m),
        f"{base.impl} calibrated on {base.schedule} at M={m}, predicting the other M",
    )  # fmt: skip
    if measured.known and across.known and measured.value > across.value:
        # an extrapolated prediction is never stated tighter than a measured one
        across = replace(across, value=measured.value, where=f"{across.where}; as at M={m}")
    return PlanErrors(measured, across, swept)


def _only(swept: tuple[int, ...]) -> str:
    return f"not measured at this M (the sweep ran M={', '.join(map(str, swept))} only)"


def store_errors(store_root: str, run_id: str) -> PlanErrors:
    """The errors of predictions calibrated on a stored run: measured on the profiled configs
    of its sweep (same bench id, implementation, ranks, batch and model); unknown with no
    other config."""
    import pandas as pd

    from vpipe.trace.store import Store

    store = Store(store_root)
    meta = store.run_meta(run_id)
    runs = store.runs()
    runs = runs[runs["source"].fillna("measured") == "measured"]
    same = pd.Series(True, index=runs.index)
    for key in ("bench_id", "impl", "ranks", "batch", "model"):
        if key in meta and key in runs:
            same &= runs[key] == meta[key]
    sweep = runs[same.fillna(False).astype(bool)]
    base = next((r for r in sweep.itertuples() if r.run_id == run_id), None)
    m = meta.get("microbatches")
    if base is None or not meta.get("bench_id") or not meta.get("ranks") or "batch" not in meta:
        alone = unknown("one config measured (the run belongs to no sweep)")
        return PlanErrors(alone, alone, (int(m),) if m else ())
    events_of = lambda rid: store.events([rid])  # noqa: E731
    return plan_errors(sweep, events_of, base, int(meta["ranks"]), meta)
