"""What selective recomputation reruns, read from a run that did not recompute.

Selective recomputation (:mod:`vpipe.runtime.recompute`) reruns, in each B or I, the calls a
model marks (attention's core, activation functions). While the profiler records, every such
call sits in a ``PP:RECOMPUTABLE`` span inside its forward, in any recompute mode. So a run
without recomputation already says how long the calls took: per stage, the median over its F
actions of the time in those spans (:func:`recomputable_us`). Its share of the stage's forward
is what each backward of that stage reruns under ``selective``
(:func:`selective_shares`), measured on the host rather than counted in multiply-adds: on a
CPU, attention's softmax and the activation functions take far more than their share of the
arithmetic.

Read only from host-clock F rows: on a CUDA trace the spans are launch times, not the device's.

Full recomputation reruns the whole forward in each B or I, but not what an F action pays in a
pipeline beyond its forward: on a 2-core host the F actions of small GPT stages took 1.1-2.2x
the same forward run alone, and a recomputation priced at them came out 9-14% long
(docs/runtime.md). Where the run probed each stage's forward alone
(:func:`vpipe.sweep.split_probe.probe_forwards`, the runs table's ``forward_alone_us``),
:func:`full_shares` prices it at that; else at the whole F.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from vpipe.events import RECOMPUTABLE

__all__ = ["forward_alone_us", "full_shares", "recomputable_us", "selective_shares"]


def recomputable_us(events: pd.DataFrame, n_stages: int) -> np.ndarray | None:
    """Per stage, the median over its F rows of the microseconds spent in ``RECOMPUTABLE``
    spans inside the row (same rank); None when the run has no such spans or no host-clock
    F rows."""
    kind, names = events["kind"].astype(str), events["name"].astype(str)
    marks = events[(kind == "other") & (names == RECOMPUTABLE)]
    host = events["clock"].astype(str) == "host" if "clock" in events else True
    fwd = events[(kind == "F") & ~names.str.startswith("(") & host]
    if marks.empty or fwd.empty:
        return None
    inside = pd.Series(0.0, index=fwd.index)
    for rank, m in marks.groupby("rank", observed=True):
        m = m.sort_values("start_ns")
        starts = m["start_ns"].to_numpy()
        total = np.concatenate(([0], np.cumsum((m["end_ns"] - m["start_ns"]).to_numpy())))
        f = fwd[fwd["rank"] == rank]
        lo = np.searchsorted(starts, f["start_ns"].to_numpy(), side="left")
        hi = np.searchsorted(starts, f["end_ns"].to_numpy(), side="left")
        inside[f.index] = (total[hi] - total[lo]) / 1e3
    per_stage = inside.groupby(fwd["stage"]).median()
    return np.array([float(per_stage.get(s, 0.0)) for s in range(n_stages)])


def selective_shares(cal: Any, n_stages: int, n_units: int) -> np.ndarray | None:
    """Per stage of an ``n_stages`` split of the calibrated model (``n_units`` equal pieces),
    the share of its forward that selective recomputation reruns: its RECOMPUTABLE time over
    its F time, both summed over its pieces. None when the calibration run had no spans."""
    from vpipe.predict.pieces import rescale_stages

    if cal.recomputable is None:
        return None
    rec, f = cal.recomputable, cal.f
    if n_stages != cal.n_stages:
        rec, f = (rescale_stages(x, n_units, n_stages) for x in (rec, f))
    return np.clip(rec / f, 0.0, 1.0)


def forward_alone_us(row: Any) -> np.ndarray | None:
    """A run's forward probe per stage in microseconds (its runs-table row, a row tuple or its
    metadata: ``forward_alone_us``, a JSON list), NaN where a stage was not probed; None where
    the run has none."""
    import json

    from vpipe.predict.split_cost import run_value

    value = run_value(row, "forward_alone_us")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, list) or not value:
        return None
    out = np.array(value, dtype=float)  # None -> NaN
    return out if np.isfinite(out).any() else None


def full_shares(cal: Any, n_stages: int, n_units: int) -> np.ndarray | float:
    """Per stage of an ``n_stages`` split of the calibrated model, the share of its calibrated
    F that a full recomputation reruns: its forward alone over its F (at most 1; 1 for a stage
    not probed), both summed over its pieces; 1 without a probe."""
    from vpipe.predict.pieces import rescale_stages

    alone = getattr(cal, "forward_alone", None)
    if alone is None or len(alone) != cal.n_stages:
        return 1.0
    alone = np.where(np.isfinite(alone), alone, cal.f)  # not probed: the whole F
    f = cal.f
    if n_stages != cal.n_stages:
        alone, f = (rescale_stages(x, n_units, n_stages) for x in (alone, f))
    return np.clip(alone / f, 0.0, 1.0)
