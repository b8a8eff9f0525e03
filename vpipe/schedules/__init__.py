"""Schedule generators, registered by name.

``make_schedule(name, ranks, microbatches, stages_per_rank=None)`` returns a compute-only
:class:`vpipe.ir.Schedule` (F, B, I, W and overlap actions; no communication). Each family
lives in its own module: ``simple`` (gpipe, 1f1b), ``interleaved`` (interleaved-1f1b,
looped-bfs, zb-h1) and ``v`` (zbv, dualpipev).
"""

from __future__ import annotations

from collections.abc import Callable

from vpipe.errors import ScheduleError
from vpipe.ir import Schedule
from vpipe.schedules.interleaved import interleaved_1f1b, looped_bfs, zb_h1
from vpipe.schedules.simple import gpipe, one_f_one_b
from vpipe.schedules.v import dualpipev, zbv

__all__ = ["GENERATORS", "make_schedule", "schedule_names"]

Generator = Callable[[int, int, "int | None"], Schedule]

# name -> (generator, one-line description)
GENERATORS: dict[str, tuple[Generator, str]] = {
    "gpipe": (gpipe, "all forwards, then all backwards; 1 stage/rank; any P, M"),
    "1f1b": (one_f_one_b, "warm-up, one forward one backward, drain; 1 stage/rank; any P, M"),
    "interleaved-1f1b": (
        interleaved_1f1b,
        "Megatron virtual pipeline: v stages/rank (default 2), loop placement; any P, M, v",
    ),
    "looped-bfs": (
        looped_bfs,
        "breadth-first: all microbatches stage by stage; v stages/rank (default 2); any P, M, v",
    ),
    "zb-h1": (
        zb_h1,
        "zero bubble H1: 1F1B memory, I/W split, W's fill the drain; v stages/rank (default 1)",
    ),
    "zbv": (zbv, "zero bubble V: V placement, 2 stages/rank, I/W split; any P, M"),
    "dualpipev": (
        dualpipev,
        "DeepSeek DualPipeV: V placement, 2 stages/rank, (F;B) overlap actions; any P, M",
    ),
}


def schedule_names() -> dict[str, str]:
    """Registered schedule names with one-line descriptions."""
    return {name: desc for name, (_, desc) in GENERATORS.items()}


def make_schedule(
    name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None
) -> Schedule:
    """Generate the named schedule for ``ranks`` ranks and ``microbatches`` microbatches.

    ``stages_per_rank=None`` takes the family's default. Unknown names and combinations a
    family cannot run raise :class:`ScheduleError` saying what would work.
    """
    entry = GENERATORS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(GENERATORS)}")
    return entry[0](ranks, microbatches, stages_per_rank)
