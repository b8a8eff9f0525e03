"""Where a prediction's time comes from: each calibrated term's share of a predicted step.

A prediction (:func:`vpipe.predict.calibrate.predict`) adds up compute and terms that do not
scale with it. To check a prediction against what was timed, a reader needs each term's weight:
:func:`breakdown` simulates every target with one term removed at a time and reports what the
step loses, in milliseconds:

- ``level``: the anchor (:func:`vpipe.predict.calibrate.anchor`), the step with the profiled
  steps' own compute level instead of the timed median's;
- ``posting``: SEND/RECV posting (``post``), ``gaps``: the executor's time between actions
  (``gap``), ``link``: message latency and handshake, ``comm threads``: the communication
  threads' CPU where it comes out of compute's cores (:func:`vpipe.predict.calibrate.with_comm_threads`),
  ``split``: what a split backward costs over a fused B (:mod:`vpipe.predict.split_cost`);
- ``w_share``: when the calibration had only B, how far the step moves if W's assumed share of
  a backward is 0.4 or 0.6 instead of the assumed one (the larger change);
- ``restaged``: whether the target splits the model into other stages than the calibration
  (per-stage costs then come from equal model pieces, :func:`vpipe.predict.pieces.rescale_stages`).

The terms overlap (removing two at once is not the sum of removing each), so they explain,
rather than add up to, the predicted step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pandas as pd

from vpipe.predict.calibrate import US, Calibration, predict, split_backward

__all__ = ["breakdown"]


def _step_ms(cal: Calibration, schedule: Any, n_units: int | None) -> float:
    return predict(cal, schedule, n_units).makespan * US / 1e6


def _with_share(cal: Calibration, share: float) -> Calibration:
    """``cal`` with its backwards split with W's share ``share``."""
    b, w = split_backward(cal.b + cal.w, share)
    return replace(cal, b=b, w=w, w_share=share)


def breakdown(
    cal: Calibration,
    targets: list[tuple[str, Any, float | None]],
    n_units: int | None = None,
) -> pd.DataFrame:
    """One row per ``(label, schedule, timed seconds or None)`` target: the predicted and timed
    step (ms), the error, and what the predicted step loses without each term (ms; see the
    module docstring)."""
    rows = []
    for label, schedule, timed_s in targets:
        step = _step_ms(cal, schedule, n_units)
        row: dict[str, Any] = {"schedule": label, "predicted ms": step}
        if timed_s:
            row["timed ms"] = timed_s * 1e3
            row["error"] = step / (timed_s * 1e3) - 1
        without = {
            "level": replace(cal, compute_scale=1.0),
            "posting": replace(cal, post=0.0),
            "gaps": replace(cal, gap=0.0),
            "link": replace(cal, comm_latency=0.0, comm_handshake=0.0),
            "comm threads": replace(cal, comm_threads=0.0),
            "split": replace(cal, split_ratio=None),
        }
        for term, other in without.items():
            row[term] = step - _step_ms(other, schedule, n_units)
        if cal.w_share is not None:
            moved = [_step_ms(_with_share(cal, s), schedule, n_units) - step for s in (0.4, 0.6)]
            row["w_share"] = max(moved, key=abs)
        row["restaged"] = "yes" if schedule.n_stages != cal.n_stages else ""
        rows.append(row)
    return pd.DataFrame(rows)
