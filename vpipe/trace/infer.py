"""A run's metadata from its trace alone, for traces that carry none of vpipe's (those written
by torch.distributed.pipelining or another runtime).

- ranks: the world size of the trace's ``distributedInfo`` (else the ranks present);
- the program each rank ran: its compute rows of the first profiled step, in order, as actions;
  from it stages, placement (which rank runs which stage) and microbatches;
- the schedule: the catalogue family whose program is exactly that one (its name; torch's class
  where the family has one), else ``custom`` (``vpipe trace --csv`` writes the program out).

What cannot be inferred (a rank that names no actions, whose runs of operators follow no
catalogue program: :mod:`vpipe.trace.run_actions`) is left out, and commands that need it
ask for it by its flag.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from vpipe.errors import ScheduleError
from vpipe.events import COMPUTE_KINDS
from vpipe.ir import Schedule, parse_action
from vpipe.schedules import catalogue, make_schedule
from vpipe.trace.operators import RUN_NAME


def program_of(events: pd.DataFrame, n_ranks: int) -> Schedule | None:
    """The compute program of the first profiled step, one action list per rank (runs of
    operators outside every action left out); None when a rank of ``n_ranks`` names none."""
    ev = events[events["kind"].astype(str).isin(COMPUTE_KINDS)]
    ev = ev[ev["name"].astype(str) != RUN_NAME]  # a step's own work outside its actions
    if ev.empty:
        return None
    ev = ev[ev["step"] == ev["step"].min()].sort_values(["rank", "start_ns", "end_ns"])
    names = ev["name"].astype(str)
    actions: list[list] = []
    for r in range(n_ranks):
        mine = names[ev["rank"] == r]
        seen: list[str] = []
        for n in mine:  # an overlap action's parts share its name: one action
            if not seen or seen[-1] != n or not n.startswith("("):
                seen.append(n)
        try:
            actions.append([parse_action(n) for n in seen])
        except (ScheduleError, ValueError):
            return None  # operator runs, not actions
        if not seen:
            return None
    stages = ev["stage"].to_numpy()
    placement = {int(s): int(r) for s, r in zip(stages, ev["rank"], strict=True)}
    n_stages = max(placement) + 1
    if sorted(placement) != list(range(n_stages)):
        return None
    n_mb = int(ev["microbatch"].max()) + 1
    return Schedule(n_ranks, n_stages, n_mb, placement, actions, name="custom")


def matching_family(program: Schedule) -> catalogue.Family | None:
    """The catalogue family whose generated program equals ``program`` (the families torch has
    a class for first)."""
    fams = sorted(catalogue.families(), key=lambda f: f.torch_class is None)
    for fam in fams:
        if program.n_stages % program.n_ranks:
            return None
        try:
            made = make_schedule(
                fam.name, program.n_ranks, program.n_microbatches, program.stages_per_rank
            )
        except (ScheduleError, ValueError, TypeError):
            continue
        if made.compute_only() == program:
            return fam
    return None


def inferred_meta(events: pd.DataFrame, world_size: int | None) -> dict[str, Any]:
    """ranks, stages, placement, microbatches, schedule (and torch_class, program) of a run
    from its events; the keys that cannot be inferred are absent."""
    present = sorted(int(r) for r in events["rank"].unique())
    n_ranks = world_size or (max(present) + 1 if present else 0)
    out: dict[str, Any] = {"ranks": n_ranks} if n_ranks else {}
    program = program_of(events, n_ranks) if n_ranks else None
    if program is None:
        return out
    fam = matching_family(program)
    out.update(
        stages=program.n_stages,
        microbatches=program.n_microbatches,
        placement={str(s): r for s, r in sorted(program.placement.items())},
        schedule=fam.name if fam else "custom",
        program=program.to_csv(),
    )
    if fam is not None and fam.torch_class:
        out["torch_class"] = fam.torch_class
    return out
