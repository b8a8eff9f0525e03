"""The tie rule: which schedule to run when candidates cannot be told apart.

Candidates whose step times are within the prediction's error of the fastest (``vpipe plan``,
the bench report's plan section) or whose measured paired interval cannot separate them from
the fastest (a sweep's verdict, :mod:`vpipe.report.winner`) are a tie. A tie is broken by
:data:`TIE_RULE`: less peak memory per rank, then the simpler schedule: fewer stages per rank,
then the family the catalogue lists first (its display order goes from the simplest), then
fewer microbatches. Plan and reports both call :func:`break_tie`, so they cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vpipe.errors import ScheduleError
from vpipe.schedules import catalogue

__all__ = ["TIE_RULE", "Tied", "break_tie"]

TIE_RULE = (
    "less peak memory per rank, then the simpler schedule (fewer stages per rank, then the "
    "family the catalogue lists first, then fewer microbatches)"
)


@dataclass(frozen=True)
class Tied:
    """One candidate of a tie: its family, its peak memory per rank (any unit, the same for
    every candidate; NaN or None when unknown: it loses on memory), its stages per rank (None:
    the family's default) and microbatch count (0 when all share one)."""

    schedule: str
    memory: float | None
    stages_per_rank: int | None = None
    microbatches: int = 0


def _key(c: Tied) -> tuple[float, int, int, int]:
    try:
        family = catalogue.get(c.schedule)
        order, spr = family.order, c.stages_per_rank or family.stages_per_rank
    except ScheduleError:  # a schedule outside the catalogue (a CSV file): simplest last
        order, spr = math.inf, c.stages_per_rank or 1
    memory = math.inf if c.memory is None or c.memory != c.memory else float(c.memory)
    return memory, spr, order, c.microbatches


def break_tie(tied: Sequence[Tied]) -> int:
    """The index in ``tied`` of the candidate to run, by :data:`TIE_RULE` (the first of
    equals)."""
    if not tied:
        raise ValueError("a tie needs at least one candidate")
    return min(range(len(tied)), key=lambda i: _key(tied[i]))
