"""How well the timed step times that judge a fidelity table are known.

A fidelity table (rows: calibrated on; columns: predicted) judges each prediction against a
ratio of two configs' timed medians. Each median comes from a few dozen noisy steps, so that
ratio has an interval of its own (:func:`vpipe.stats.ratio_of_medians`, 95%, bootstrap): a
prediction inside it has an error the timing cannot tell from none; one outside it is wrong by
at least its distance to the interval. With fewer than :data:`vpipe.stats.MIN_SAMPLES` steps a
config's median has no interval, and its cells are not judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from vpipe.stats import median_precision, ratio_of_medians

__all__ = [
    "outside_timing",
    "ratio_intervals",
    "sweep_intervals",
    "sweep_timing_sentence",
    "timing_sentence",
]


def ratio_intervals(times: Mapping[str, Any], timed: Mapping[str, float]) -> dict[str, Any]:
    """From each config's timed step times (``times``) and the medians its predictions were
    judged against (``timed``): ``own``, per config its step count and the relative half-width
    of its median's interval (the larger side); ``low`` and ``high``, per cell (rows:
    calibrated on, columns: predicted) the interval of timed(column) / timed(row) over the
    judged medians' ratio."""
    labels = [k for k in timed if k in times]
    steps = {k: np.asarray(times[k], dtype=float) for k in labels}
    low = pd.DataFrame(np.nan, index=labels, columns=labels)
    high = low.copy()
    for c in labels:
        for t in labels:
            if c != t:
                r = ratio_of_medians(steps[t], steps[c])
                base = timed[t] / timed[c]
                low.loc[c, t], high.loc[c, t] = r.low / base, r.high / base
    own = {k: (len(steps[k]), median_precision(steps[k])) for k in labels}
    return {"low": low, "high": high, "own": own}


def outside_timing(table: pd.DataFrame, intervals: Mapping[str, Any]) -> list[float]:
    """Per held-out cell of ``table`` (errors; rows: calibrated on) whose prediction lies
    outside its timed ratio's interval, how far (relative)."""
    low, high = intervals["low"], intervals["high"]
    out = []
    for c in low.index:
        for t in low.columns:
            if c == t or pd.isna(low.loc[c, t]) or c not in table.index or t not in table:
                continue
            made = 1 + table.loc[c, t]  # the prediction over the judged timed ratio
            if made < low.loc[c, t] or made > high.loc[c, t]:
                out.append(max(low.loc[c, t] - made, made - high.loc[c, t]))
    return out


def timing_sentence(table: pd.DataFrame, intervals: Mapping[str, Any]) -> str:
    """One sentence for a report: how well the timed ratios are known, and how many of the
    table's predictions fall outside them."""
    low, high = intervals["low"], intervals["high"]
    half = np.maximum(high.to_numpy() - 1, 1 - low.to_numpy())
    judged = half[np.isfinite(half)]
    if not judged.size:
        return ("The timed steps are too few to bound the timed ratios these errors are "
                "judged against, so no error here can be told from the timing's noise.")  # fmt: skip
    beyond = outside_timing(table, intervals)
    return (f"The timed ratios these errors are judged against are known to "
            f"+-{judged.min() * 100:.1f}% to +-{judged.max() * 100:.1f}% (95%, over the timed "
            f"steps); {len(beyond)} of {judged.size} predictions lie outside them"
            + (f", by at most {max(beyond) * 100:.1f}%" if beyond else "")
            + ": the others' errors the timing cannot tell from none.")  # fmt: skip


def sweep_intervals(steps: pd.DataFrame, runs: pd.DataFrame, impl: str,
                    m: int) -> dict[str, Any]:  # fmt: skip
    """:func:`ratio_intervals` of one implementation and microbatch count of a sweep: its
    timed ``steps`` (``steps.parquet``) and its measured ``runs`` (what each was judged
    against)."""
    from vpipe.predict.calibrate import judged_against

    runs = runs[(runs["impl"] == impl) & (runs["microbatches"] == m)]
    steps = steps[(steps["impl"] == impl) & (steps["microbatches"] == m)]
    times = {k: g["step_time_s"].to_numpy() for k, g in steps.groupby("schedule")}
    return ratio_intervals(times, {r.schedule: judged_against(r) for r in runs.itertuples()})


def sweep_timing_sentence(steps: pd.DataFrame, runs: pd.DataFrame, impl: str, m: int,
                          table: pd.DataFrame) -> str:  # fmt: skip
    """:func:`timing_sentence` of a sweep's leave-one-out ``table`` (with its ``calibrated
    on`` column) for one implementation and microbatch count (:func:`sweep_intervals`)."""
    errors = table.set_index("calibrated on")
    return timing_sentence(errors, sweep_intervals(steps, runs, impl, m))
