"""The one-line verdict of a single sweep: which schedule wins, with its interval, or "no
winner at this noise" and the rounds that would settle it.

Per (microbatches, implementation), the two fastest schedules by median step time are
compared by the within-run paired ratio (:func:`vpipe.report.document.paired_configs`: steps paired
by round and step index, measured back to back, bootstrap interval); the faster one wins when
the interval excludes 1. Otherwise :func:`vpipe.report.crossrun.paired_rounds_to_settle` estimates
from the observed spread how many rounds (``vpipe bench --rounds N``) would make it exclude 1.
"""

from __future__ import annotations

import pandas as pd

from vpipe.report.crossrun import paired_rounds_to_settle
from vpipe.report.document import config_times, paired_configs


def winner_line(steps: pd.DataFrame, rounds: int) -> str:
    """The sweep's verdict in one line (see the module's doc); groups joined by "; "."""
    parts = []
    for (m, impl), d in steps.groupby(["microbatches", "impl"], sort=True, observed=True):
        medians = d.groupby("schedule", observed=True)["step_time_s"].median().sort_values()
        if len(medians) < 2:
            continue
        first, second = medians.index[0], medians.index[1]
        r = paired_configs(config_times(d, second, m, impl), config_times(d, first, m, impl))
        where = f"M={m} {impl}"
        if r.has_interval and r.low > 1:
            parts.append(
                f"winner ({where}): {first}, {r.value:.2f}x faster than {second} "
                f"(95% CI {r.interval_text()})"
            )
            continue
        n = paired_rounds_to_settle(r.value, r.low, r.high, rounds)
        settle = f"; about {n} rounds would settle it (--rounds {n})" if n else ""
        ci = f" (95% CI {r.interval_text()})" if r.has_interval else " (too few steps)"
        parts.append(
            f"no winner at this noise ({where}): {first} vs {second} {r.value:.2f}x{ci}{settle}"
        )
    return "; ".join(parts) or "one schedule per group: nothing to rank"
