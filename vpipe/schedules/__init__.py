"""Schedule generators, registered by name in :mod:`vpipe.schedules.catalogue`.

``make_schedule(name, ranks, microbatches, stages_per_rank=None)`` returns a compute-only
:class:`vpipe.ir.Schedule` (F, B, I, W and overlap actions; no communication). Each family
lives in its own module: ``simple`` (gpipe, 1f1b), ``interleaved`` (interleaved-1f1b,
looped-bfs, zb-h1) and ``v`` (zbv, dualpipev); :mod:`vpipe.schedules.load` reads a schedule
by name or from a CSV file.
"""

from __future__ import annotations

from typing import Any

from vpipe.ir import Schedule
from vpipe.schedules import catalogue
from vpipe.schedules.catalogue import Generator, LiveView

__all__ = ["GENERATORS", "make_schedule", "schedule_names"]

# name -> (generator, one-line description), following the catalogue as it changes
GENERATORS: LiveView[tuple[Generator, str]] = LiveView(lambda f: (f.generator, f.description))


def schedule_names() -> dict[str, str]:
    """Registered schedule names with one-line descriptions, in display order."""
    return {f.name: f.description for f in catalogue.families()}


def make_schedule(
    name: str,
    ranks: int,
    microbatches: int,
    stages_per_rank: int | None = None,
    costs: Any = None,
) -> Schedule:
    """Generate the named schedule for ``ranks`` ranks and ``microbatches`` microbatches.

    ``stages_per_rank=None`` takes the family's default. ``costs``: a cost model
    (:class:`vpipe.sim.CostModel`, per stage or per rank's share as the simulator reads it)
    that the cost-adapted families (``auto``, ``v-half``, ``v-min``) schedule for; the others
    do not depend on costs, and None means unit costs. Unknown names and combinations a
    family cannot run raise :class:`ScheduleError` saying what would work.
    """
    family = catalogue.get(name)
    if costs is None or not family.cost_adapted:
        return family.generator(ranks, microbatches, stages_per_rank)
    if hasattr(costs, "for_schedule"):  # per rank's share: each of V stages gets 1/V
        costs = costs.for_schedule(stages_per_rank or family.stages_per_rank)
    return family.generator(ranks, microbatches, stages_per_rank, costs=costs)
