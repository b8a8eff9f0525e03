"""The flags that steer ``auto`` on ``vpipe show`` and ``vpipe simulate``: the costs it
schedules for, the memory limit, the placement, the objective and the exact mode.

``vpipe show auto --ranks 8 --microbatches 24 --cost f=18.5,b=18.1,w=9.3,comm=0.6 --memory
16units --placement loop --objective span --csv auto.csv`` writes the schedule auto chose for
those costs. No torch or pandas import here.
"""

from __future__ import annotations

import argparse
from typing import Any

from vpipe.errors import ScheduleError
from vpipe.ir import Schedule

OBJECTIVE_HELP = (
    "makespan: ranks start together, the step ends with the last one (synchronous optimizer "
    "step); span: the longest rank span, first F to last W (iterations overlapping, the "
    "papers' measure)"
)
AUTO_FLAGS = ("memory", "placement", "i_frees", "exact", "time_limit")


def add_auto_flags(p: argparse.ArgumentParser, *, cost: bool) -> None:
    """Add auto's flags (and ``--objective``) to a parser; ``cost``: add ``--cost`` too."""
    g = p.add_argument_group("auto (schedule NAME_OR_CSV = auto)")
    if cost:
        g.add_argument(
            "--cost", metavar="SPEC", help="costs the cost-adapted schedules (auto, v-half, "
            "v-min) are scheduled for, read as simulate reads them (per rank's share unless "
            "unit=stage), e.g. f=1,b=1,w=1,comm=0 (the default; see vpipe.sim.CostModel.parse); "
            "act_bytes= for auto's limit in bytes"
        )  # fmt: skip
    g.add_argument(
        "--memory", metavar="LIMIT", help="activation memory per rank: units of a 1F1B stage "
        "(16units) or bytes (12GiB, with act_bytes= in --cost); default 2P units"
    )  # fmt: skip
    g.add_argument("--placement", choices=("loop", "v", "interleaved"), help="default v")
    g.add_argument(
        "--i-frees", type=float, metavar="SHARE", dest="i_frees",
        help="share of a forward's activations its input gradient frees (default 0: all held "
        "until the weight gradient)",
    )  # fmt: skip
    g.add_argument(
        "--exact", action="store_true",
        help="prove the optimum with OR-Tools CP-SAT (pip install 'vpipe[solver]'), started "
        "from the heuristic",
    )  # fmt: skip
    g.add_argument(
        "--time-limit", type=float, metavar="S", dest="time_limit", help="for --exact (60)"
    )
    p.add_argument("--objective", choices=("makespan", "span"), default=None, help=OBJECTIVE_HELP)


def wants_auto(args: argparse.Namespace, *, cost_counts: bool) -> bool:
    """Whether the command should build ``auto`` from the flags: the source is auto and some
    auto flag or --objective is given (or --cost, when ``cost_counts``: on ``vpipe show``
    it is auto's own flag)."""
    from vpipe.schedules import catalogue

    try:
        name = catalogue.canonical(args.source)
    except Exception:
        return False
    given = any(getattr(args, k, None) not in (None, False) for k in AUTO_FLAGS)
    given = given or args.objective is not None or (cost_counts and args.cost is not None)
    return name == "auto" and given


def auto_from_args(args: argparse.Namespace, costs: Any) -> Schedule:
    """The schedule ``auto`` picks for the command's flags under ``costs`` (a CostModel, read
    as the simulator reads it: per rank's share is split evenly over the stages per rank)."""
    from vpipe.schedules.adaptive import MemoryModel
    from vpipe.schedules.auto import auto_schedule

    if args.ranks is None or args.microbatches is None:
        raise ScheduleError("auto needs --ranks and --microbatches")
    p, placement = args.ranks, args.placement or "v"
    spr = {"v": 2, "loop": 1}.get(placement) or args.stages_per_rank or 2
    n = p * spr
    costs = costs.for_schedule(spr)
    share = 0.0 if args.i_frees is None else args.i_frees
    if not 0.0 <= share <= 1.0:
        raise ScheduleError(f"--i-frees must be between 0 and 1, got {share:g}")
    limit, memory = 2.0 * p, None
    if args.memory is not None:
        from vpipe.predict.plan import Budget

        budget = Budget.parse(args.memory)
        limit = budget.value
        if not budget.units:
            alloc = costs.stage_activation_bytes(n)
            if alloc is None or not alloc.any():
                raise ScheduleError(
                    f"--memory {args.memory}: a limit in bytes needs act_bytes= in --cost "
                    "(bytes one stage saves per microbatch), or give units (e.g. 16units)"
                )
            memory = MemoryModel.from_bytes(alloc, alloc * share)
    if memory is None:
        strict = MemoryModel.strict(p, n)
        memory = MemoryModel(strict.alloc, tuple(a * share for a in strict.alloc))
    return auto_schedule(
        p, args.microbatches, costs, limit, placement, objective=args.objective or "makespan",
        memory=memory, stages_per_rank=spr if placement == "interleaved" else None,
        exact=args.exact, time_limit=args.time_limit or 60.0,
    )  # fmt: skip


def describe_auto(schedule: Schedule) -> str:
    """One line on what auto chose and by which objective (and the solver's verdict)."""
    meta = schedule.meta
    source = meta.get("source")
    text = (
        f"{schedule.name} chose {source if isinstance(source, str) else 'a building block'} by "
        f"{meta.get('objective')} {meta.get('objective_value', 0):g} under memory limit "
        f"{meta.get('memory_limit'):g} (peak {meta.get('peak', 0):g})"
    )
    exact = meta.get("exact")
    if exact:
        text += (
            f"; solver: {exact['status']}, bound {exact['bound']:g}, gap {exact['gap']:.2%} "
            f"in {exact['wall_s']:.1f} s"
        )
    return text
