"""A measured step replayed with its own action times: the bubble its schedule alone gives.

The calibrated simulator (:func:`vpipe.predict.calibrate.predict`) runs every action at its stage's
median cost. On a loaded host the actions of one step vary (a preempted W takes twice its
median), and a slow action makes its peer wait: bubble that the schedule and the machine cause
together, not the runtime. Replaying each profiled step with the times its own actions took,
the calibrated link (latency and handshake) and no runtime overhead (no posting, no gaps)
gives that step's **own bubble**; the measured bubble minus it is what the runtime added.

An overlap action's parts share one traced interval (their split is not observable): its
computing time (the interval less the waits inside it) is split between the parts in
proportion to their calibrated costs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pandas as pd

from vpipe.events import COMPUTE_KINDS
from vpipe.metrics.per_run import step_metrics
from vpipe.predict.calibrate import COMPOUND_KEYS, US, Calibration, compound_parts

__all__ = ["action_times", "own_bubbles"]


def action_times(events: pd.DataFrame, cal: Calibration) -> dict[int, dict[tuple, float]]:
    """Per step, each compute action's time in calibration units (microseconds), keyed by
    (stage, kind letter, microbatch) as :func:`vpipe.sim.simulate` takes them."""
    ev = events[(events["step"] >= 0) & events["kind"].astype(str).isin(COMPUTE_KINDS)]
    ev = ev.reset_index(drop=True)
    ev = ev.assign(kind=ev["kind"].astype(str), us=(ev["end_ns"] - ev["start_ns"]) / US)
    parts = compound_parts(ev, cal.f, cal.b, cal.w, cal.fused_backward())
    if len(parts):
        own_sum = parts.groupby(COMPOUND_KEYS, observed=True)["own"].transform("sum")
        share = (parts["own"] / own_sum).where(own_sum > 0, 1 / 2)
        ev = pd.concat([ev.drop(parts.index), parts.assign(us=parts["computing"] * share)])
    out: dict[int, dict[tuple, float]] = {}
    for step, s, k, m, us in zip(
        ev["step"], ev["stage"], ev["kind"], ev["microbatch"], ev["us"], strict=True
    ):
        out.setdefault(int(step), {})[int(s), k, int(m)] = float(us)
    return out


def own_bubbles(
    events: pd.DataFrame, cal: Calibration, schedule: Any, *, recv_lookahead: int = 1
) -> pd.DataFrame:
    """Per profiled step of one measured run of ``schedule`` (compute-only, as the run's
    program was lowered from with ``recv_lookahead``): its measured bubble ratio, its own
    bubble (the replay, see the module docstring) and the difference."""
    from vpipe.sim import simulate

    costs = replace(cal.cost_model(schedule), post=0.0, gap=0.0)
    measured = step_metrics(events[events["step"] >= 0]).set_index("step")["bubble_ratio"]
    rows = []
    for step, times in sorted(action_times(events, cal).items()):
        own = simulate(schedule, costs, recv_lookahead=recv_lookahead, action_times=times)
        bubble = float(measured[step])
        rows.append(
            {
                "step": step,
                "bubble": bubble,
                "own": own.bubble_ratio,
                "added": bubble - own.bubble_ratio,
            }
        )
    return pd.DataFrame(rows, columns=["step", "bubble", "own", "added"])
