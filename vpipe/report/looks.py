"""The error rate of a ``vpipe ab`` session, spent over its looks at its verdicts and split
over the verdicts each look shows.

A session's confidence is simultaneous over the configs and over every look it takes at its
verdicts, so stopping when the verdict is settled does not raise the false-alarm rate: the
session's 5% is spent over its looks (:func:`look_alpha`; their union bounds the false
alarms whatever the looks' correlation), half of it kept for the last look (the one a
session that has not settled early ends on, where the most pairs are), the other half shared
evenly by the looks expected before it, and at each look split over the verdicts shown
(Bonferroni): with several configs, half to the verdict over all of them and the other half
evenly over the configs (:func:`levels`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vpipe.stats import CONFIDENCE

ALPHA = 1 - CONFIDENCE  # a session's false-alarm rate over all its configs and looks
# The share of ALPHA kept for a session's last look. A session that settles early does so on a
# clear difference, where a stricter look costs a pair or two; one that runs to its limit (a
# small difference, or a hog) ends on the last look, whose interval this share narrows (2
# configs, 8 pairs: z = 2.50 at the last look, 3.08 at the 6 before it; 2.91 at every look
# when 7 looks share 5% evenly)
FINAL_SHARE = 0.5


def look_alpha(spent: float, interim_left: int) -> float:
    """The error rate (over all configs) a look spends, ``spent`` having gone to the looks
    before it: the last look (``interim_left`` 0) takes all of :data:`ALPHA` that is left; an
    earlier one an even share of what is left of the rest, (1 - FINAL_SHARE) x ALPHA, over
    the ``interim_left`` looks now expected before the last, itself included (the expectation
    may change between looks, as a time limit draws nearer; the shares never exceed the rest,
    and once it is spent an earlier look gets 0: no look is taken until the last)."""
    if interim_left <= 0:
        return max(ALPHA - spent, 0.0)
    return max((1 - FINAL_SHARE) * ALPHA - spent, 0.0) / interim_left


# The share of a look's error rate that the verdict over all configs takes (with several):
# the question a session asks first, is B slower, faster or neither across the sweep; the
# configs share the rest. Their mean cancels much of each config's noise (pairs' log sd 0.081
# over 2 configs against 0.116 for one, normalised, quiet: python -m bench.false_alarms --ab)
OVERALL_SHARE = 0.5


def levels(alpha: float, configs: int) -> tuple[float, float]:
    """The interval levels at a look spending ``alpha``: (over all configs, each config).
    With several configs the verdict over all takes :data:`OVERALL_SHARE` of alpha and each
    config an even share of the rest (Bonferroni over all the verdicts shown); one config is
    its own overall verdict, at 1 - alpha."""
    if configs <= 1:
        return 1 - alpha, 1 - alpha
    return 1 - OVERALL_SHARE * alpha, 1 - (1 - OVERALL_SHARE) * alpha / configs


def report_alpha(looks: Sequence[Mapping[str, Any]]) -> float:
    """The error rate of a session's report, from its looks (each: its ``alpha``, whether it
    was the ``last`` and whether it ``settled``): the look that ended the session (settled, or
    the last); after an interruption, a new last look taking what is left; without a look
    (fewer than :data:`vpipe.report.pairs.MIN_PAIRS` pairs), all of :data:`ALPHA`."""
    if looks and (looks[-1]["last"] or looks[-1]["settled"]):
        return float(looks[-1]["alpha"])
    return look_alpha(sum(float(x["alpha"]) for x in looks), 0)
