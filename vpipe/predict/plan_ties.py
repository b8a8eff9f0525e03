"""Which of ``vpipe plan``'s candidates are a tie, and how a tie reads.

A prediction is only as good as the simulator: candidates predicted within its error of the
fastest cannot be ordered by it, so they are a tie, which :func:`vpipe.predict.plan.recommend`
breaks by the tie rule (:mod:`vpipe.schedules.ties`).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

__all__ = ["PREDICTION_ERROR", "candidate_label", "tie_note", "tied"]

# The default tie band (relative), used only where the error of the predictions is unknown
# (vpipe.predict.plan_error): the simulator's fidelity goal against the timed median.
PREDICTION_ERROR = 0.05


def tied(
    found: list[Any], tie: float = PREDICTION_ERROR, measured_m: Collection[int] | None = None
) -> list[Any]:
    """The fitting candidates predicted within ``tie`` (relative: the prediction's error) of
    the fastest fitting one, fastest first: a tie, since the predictions cannot order them.
    With ``measured_m``, only candidates at those microbatch counts (the ones a sweep
    measured), when any of them fits."""
    fitting = [c for c in found if c.fits]
    if measured_m is not None and any(c.microbatches in measured_m for c in fitting):
        fitting = [c for c in fitting if c.microbatches in measured_m]
    fastest = min((c.predicted_step_s for c in fitting), default=math.inf)
    within = [c for c in fitting if c.predicted_step_s <= fastest * (1 + tie)]
    return sorted(within, key=lambda c: c.predicted_step_s)


def tie_note(result: dict[str, Any]) -> str:
    """A :func:`vpipe.predict.plan.plan` result's tie in words: how many candidates were predicted within the
    tie band of the fastest, where the band comes from (``tie_source``: the measured error,
    ``--tie``, the default), and the rule that picked the recommended one."""
    tie_set = result["tied"]
    fastest = tie_set[0]
    source = result.get("tie_source", "--tie")
    return (
        f"a tie: {len(tie_set)} candidates predicted within {result['tie']:.1%} of the "
        f"fastest ({source}), {candidate_label(fastest)} at "
        f"{fastest['predicted_step_s'] * 1e3:.2f} ms; broken by {result['tie_rule']}"
    )


def candidate_label(c: dict[str, Any]) -> str:
    """``family vV MM`` (and ``recompute MODE``): a candidate as tables and plots name it."""
    mode = c.get("recompute", "none")
    label = f"{c['schedule']} v{c['stages_per_rank']} M{c['microbatches']}"
    return label if mode == "none" else f"{label} recompute {mode}"
