"""Load a schedule from a NAME_OR_CSV argument: a catalogue name, or a CSV file in torch's format.

The schedule commands and ``vpipe run`` share this, so a schedule dumped by
torch.distributed.pipelining can be viewed, checked, simulated and run like a built-in one.
Errors are one-line :class:`~vpipe.errors.ScheduleError` messages naming the command-line
option at fault, since the CLI is the caller.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vpipe.errors import ScheduleError
from vpipe.ir import Schedule
from vpipe.schedules import catalogue, make_schedule

__all__ = [
    "MAX_STAGE_MICROBATCHES",
    "is_csv_source",
    "load_schedule",
    "make_named",
    "shorten",
    "validate_file",
]

# Largest ranks * stages_per_rank * microbatches a named schedule may have: about 3M compute
# actions, which simulates in well under a minute. Larger requests are refused, not left to hang.
MAX_STAGE_MICROBATCHES = 1 << 20


def is_csv_source(source: str) -> bool:
    """Whether a NAME_OR_CSV argument names a CSV file rather than a built-in schedule."""
    return _is_file(source) or source.lower().endswith(".csv")


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # embedded NUL, name too long
        return False


def load_schedule(
    source: str,
    ranks: int | None = None,
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    costs: Any = None,
) -> Schedule:
    """A built-in schedule by name (the cost-adapted ones scheduled for ``costs``, see
    :func:`vpipe.schedules.make_schedule`), or a CSV file (validated, compared with the given
    sizes)."""
    if is_csv_source(source):
        if stages_per_rank is not None:
            raise ScheduleError(f"{source}: --stages-per-rank applies to built-in schedules only")
        schedule = Schedule.from_csv(source, n_ranks=ranks)
        if microbatches is not None and schedule.n_microbatches != microbatches:
            raise ScheduleError(
                f"{source}: has {schedule.n_microbatches} microbatches, "
                f"but --microbatches is {microbatches}"
            )
        validate_file(source, schedule)
        return schedule
    return make_named(source, ranks, microbatches, stages_per_rank, costs)


def make_named(
    name: str,
    ranks: int | None,
    microbatches: int | None,
    stages_per_rank: int | None,
    costs: Any = None,
) -> Schedule:
    """The catalogue's schedule ``name`` (for ``costs``, if it adapts to them), refusing
    missing sizes and sizes too large to simulate in reasonable time (see
    MAX_STAGE_MICROBATCHES)."""
    name = catalogue.canonical(name)
    names = catalogue.names()
    if name not in names:
        raise ScheduleError(
            f"unknown schedule {shorten(name)}: choose one of {', '.join(names)}, "
            "or give an existing CSV file"
        )
    if ranks is None or microbatches is None:
        raise ScheduleError(f"schedule {name!r} needs --ranks and --microbatches")
    size = ranks * (stages_per_rank or 2) * microbatches
    if size > MAX_STAGE_MICROBATCHES:
        raise ScheduleError(
            f"{name} with {ranks} ranks and {microbatches} microbatches is too large for the "
            f"CLI (ranks * stages per rank * microbatches = {size} > {MAX_STAGE_MICROBATCHES})"
        )
    return make_schedule(name, ranks, microbatches, stages_per_rank, costs)


def validate_file(path: str, schedule: Schedule) -> None:
    """Validate a schedule read from ``path``; the error names the file."""
    from vpipe.ir.lowering import validate

    try:
        validate(schedule)
    except ScheduleError as e:
        raise ScheduleError(f"{path}: {e}") from None


def shorten(text: str, limit: int = 40) -> str:
    """``repr(text)``, cut to ``limit`` characters with ``...`` so error lines stay short."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
