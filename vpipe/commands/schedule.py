"""Schedule subcommands: ``schedules``, ``show``, ``validate``, ``simulate`` and ``compare``.

Every command works on a built-in schedule name or on a CSV file in torch's format, so
schedules dumped by torch.distributed.pipelining can be viewed, checked and simulated too.
User errors surface as one-line :class:`~vpipe.errors.VpipeError` messages (argument errors are
shortened by the CLI's parser class). Loading lives in :mod:`vpipe.schedules.load`, the
side-by-side simulation in :mod:`vpipe.sim.compare`; this module parses and prints. No torch
import here.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from typing import Any

from vpipe.commands._auto_flags import add_auto_flags, auto_from_args, describe_auto, wants_auto
from vpipe.commands._grid import (
    SLOT_NOTE,
    print_grid,
    program_cells,
    render_grid,
    timed_cells,
)
from vpipe.commands._runtime_flags import positive_int
from vpipe.errors import ScheduleError, VpipeError
from vpipe.ir import Schedule
from vpipe.outputs import check_output_file
from vpipe.schedules import schedule_names
from vpipe.schedules.load import load_schedule, shorten, validate_file
from vpipe.sim.compare import COMPARE_NOTE, REFERENCE_SCHEDULE, compare_rows
from vpipe.sim.cost_model import COST_CONVENTION

UNIT_COST = "f=1,b=1,w=1,comm=0"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the schedule commands to the ``vpipe`` parser."""
    _add(subparsers, "schedules", "list the built-in schedules", _cmd_schedules)

    p = _add(subparsers, "show", "print a schedule as a grid (or write its CSV)", _cmd_show)
    _add_source(p)
    p.add_argument(
        "--lowered", action="store_true", help="show the lowered program (with SEND/RECV)"
    )
    p.add_argument("--csv", metavar="PATH", help="write the schedule in torch's CSV format")
    p.add_argument(
        "--width",
        type=positive_int,
        metavar="N",
        help="wrap the grid at this many columns (default: terminal)",
    )
    add_auto_flags(p, cost=True)

    p = _add(subparsers, "validate", "check a schedule CSV (torch's format)", _cmd_validate)
    p.add_argument("path", metavar="PATH.csv", help="CSV file, one row of actions per rank")
    p.add_argument(
        "--lowered",
        action="store_true",
        help="the file is a lowered program and must contain its SEND/RECV actions",
    )

    p = _add(subparsers, "simulate", "simulate a schedule with a cost model", _cmd_simulate)
    _add_source(p)
    _add_cost(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace JSON")
    add_auto_flags(p, cost=False)

    p = _add(subparsers, "compare", "simulate several schedules side by side", _cmd_compare)
    p.add_argument("--ranks", "-p", type=positive_int, default=4, metavar="P", help="default 4")
    p.add_argument(
        "--microbatches", "-m", type=positive_int, default=8, metavar="M", help="default 8"
    )
    p.add_argument(
        "--stages-per-rank",
        "-v",
        type=positive_int,
        metavar="V",
        help="for every schedule (default: each family's own)",
    )
    p.add_argument(
        "--schedules", metavar="A,B,...", help="comma-separated names (default: all built-in)"
    )
    _add_cost(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


# ---------------------------------------------------------------------------------------------
# Argument plumbing


def _add(
    subparsers: argparse._SubParsersAction,
    name: str,
    help_text: str,
    func: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(func=func)
    return p


def _add_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="NAME_OR_CSV", help="built-in schedule name or CSV path")
    p.add_argument("--ranks", "-p", type=positive_int, metavar="P", help="pipeline ranks")
    p.add_argument("--microbatches", "-m", type=positive_int, metavar="M", help="microbatches")
    p.add_argument(
        "--stages-per-rank",
        "-v",
        type=positive_int,
        metavar="V",
        help="stages per rank (default: the family's)",
    )


def _add_cost(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cost",
        metavar="SPEC",
        help=f"cost model, e.g. {UNIT_COST} (keys: vpipe.sim.CostModel.parse); "
        + COST_CONVENTION.replace("%", "%%"),
    )


# ---------------------------------------------------------------------------------------------
# Shared helpers


def _cost_model(spec: str | None) -> Any:
    from vpipe.sim import CostModel

    try:
        return CostModel.parse(spec if spec is not None else UNIT_COST)
    except VpipeError as e:
        raise type(e)(f"--cost: {e}") from None


def per(costs: Any) -> str:
    """How the cost string's f, b, w were read (:data:`vpipe.sim.cost_model.COST_CONVENTION`)."""
    if costs.unit == "stage":
        return "per stage"
    return "per rank's share of the model; each stage gets 1/V of it"


def describe(schedule: Schedule) -> str:
    """``4 ranks, 8 stages, 8 microbatches, placement v``."""
    return (
        f"{schedule.n_ranks} ranks, {schedule.n_stages} stages, "
        f"{schedule.n_microbatches} microbatches, placement {schedule.style}"
    )


# ---------------------------------------------------------------------------------------------
# vpipe schedules


def _cmd_schedules(args: argparse.Namespace) -> int:
    names = schedule_names()
    width = max(map(len, names), default=0)
    for name, text in names.items():
        print(f"{name.ljust(width)}  {text}")
    return 0


# ---------------------------------------------------------------------------------------------
# vpipe show


def _cmd_show(args: argparse.Namespace) -> int:
    from vpipe.ir.lowering import lower

    if args.csv:
        check_output_file(args.csv, "--csv")
    costs = _cost_model(args.cost)
    if wants_auto(args, cost_counts=True):
        schedule = auto_from_args(args, costs)
    else:
        schedule = load_schedule(
            args.source, args.ranks, args.microbatches, args.stages_per_rank, costs
        )
    if "objective" in schedule.meta:  # a cost-adapted family: say what it chose
        print(describe_auto(schedule))
    if args.lowered and not schedule.is_lowered:
        schedule = lower(schedule)
    if args.csv:
        out = schedule if args.lowered else schedule.compute_only()
        _write(args.csv, out.to_csv)
    width = args.width or shutil.get_terminal_size((120, 24)).columns
    print(f"{schedule.name}: {describe(schedule)}")
    if args.lowered:
        print("program order (one column per action, SEND/RECV included)")
        print_grid(render_grid(program_cells(schedule), width, header=False))
    else:
        print(SLOT_NOTE)
        cells = timed_cells(schedule)
        # Plain actions set a uniform slot width; only overlap actions widen their slot.
        plain = max((len(c) for row in cells for c in row if "+" not in c), default=1)
        print_grid(render_grid(cells, width, header=True, min_col_width=plain))
    return 0


def _write(path: str, writer: Callable[[str], object]) -> None:
    """Run ``writer(path)``; an unwritable path becomes a one-line error."""
    try:
        writer(path)
    except OSError as e:
        raise VpipeError(f"cannot write {path}: {e.strerror or e}") from None


# ---------------------------------------------------------------------------------------------
# vpipe validate


def _cmd_validate(args: argparse.Namespace) -> int:
    from vpipe.ir.lowering import lower, validate

    schedule = Schedule.from_csv(args.path)
    comm = next(((r, i, a) for r, i, a in schedule.iter_actions() if a.is_comm), None)
    if args.lowered:
        if comm is None and _needs_comm(schedule):
            raise ScheduleError(
                f"{args.path}: --lowered given but the file has no SEND/RECV actions "
                "(validate it without --lowered to check the compute-only schedule)"
            )
        validate_file(args.path, schedule)
        print(f"valid: {describe(schedule)}, lowered program")
        return 0
    if comm is not None:
        r, i, a = comm
        raise ScheduleError(
            f"{args.path}: rank {r}, position {i}: {a} is a communication action; "
            "pass --lowered to validate a lowered program"
        )
    validate_file(args.path, schedule)
    try:
        validate(lower(schedule))
    except ScheduleError as e:
        raise ScheduleError(f"{args.path}: after lowering: {e}") from None
    print(f"valid: {describe(schedule)}")
    return 0


def _needs_comm(schedule: Schedule) -> bool:
    """Whether some adjacent stages live on different ranks."""
    p = schedule.placement
    return any(p[s] != p[s + 1] for s in range(schedule.n_stages - 1))


# ---------------------------------------------------------------------------------------------
# vpipe simulate


def simulation_summary(result: Any) -> dict[str, Any]:
    """The JSON-ready result: the simulator's own dict (peak activations per rank in stage
    activations and in activation units, each under its own name) plus the keys the CLI
    promises."""
    out = dict(result.to_dict())
    out.update(
        makespan=float(result.makespan),
        bubble_ratio=float(result.bubble_ratio),
        bubble_ratio_per_rank=[float(x) for x in result.bubble_ratio_per_rank],
        peak_stage_activations=[int(x) for x in result.peak_stage_activations],
        peak_activation_units=[float(x) for x in result.peak_activation_units],
        comm_ops=[int(x) for x in result.comm_ops],
    )
    return out


def _cmd_simulate(args: argparse.Namespace) -> int:
    from vpipe.sim import simulate

    costs = _cost_model(args.cost)
    if args.trace:
        check_output_file(args.trace, "--trace")
    if wants_auto(args, cost_counts=False):
        schedule = auto_from_args(args, costs)
    else:
        schedule = load_schedule(
            args.source, args.ranks, args.microbatches, args.stages_per_rank, costs
        )
    result = simulate(schedule, costs)
    objective = args.objective or "makespan"
    if args.trace:
        _write(args.trace, result.to_chrome_trace)
    if args.json:
        summary = {"schedule": schedule.name, **simulation_summary(result)}
        summary.update(objective=objective, objective_value=result.objective(objective))
        print(json.dumps(summary, default=_json_default))
        return 0
    print(f"{schedule.name}: {describe(schedule)}; cost {args.cost or UNIT_COST} ({per(costs)})")
    if "objective" in schedule.meta:  # a cost-adapted family
        print(describe_auto(schedule))
    print(f"makespan       {result.makespan:g}")
    print(f"span           {result.span:g} (longest rank span, first action to last)")
    print(f"objective      {objective} = {result.objective(objective):g}")
    print(
        f"bubble ratio   {result.bubble_ratio:.3f} whole step, "
        f"{result.bubble_ratio_excl_skew:.3f} excluding start-up skew"
    )
    # Peak saved activations in the cost string's unit: stage activations, or activation units
    # (a rank's share, as compare); --json gives both, named by their unit.
    per_stage = costs.unit == "stage"
    peaks = result.peak_stage_activations if per_stage else result.peak_activation_units
    header = f"{'rank':>4}  {'bubble':>6}  {'excl. skew':>10}  {'peak act':>8}  {'comm ops':>8}"
    print(header)
    for r in range(schedule.n_ranks):
        print(
            f"{r:>4}  {result.bubble_ratio_per_rank[r]:>6.3f}  "
            f"{result.bubble_ratio_per_rank_excl_skew[r]:>10.3f}  "
            f"{peaks[r]:>8g}  {result.comm_ops[r]:>8}"
        )
    unit = (
        "stage activations (JSON: peak_stage_activations)"
        if per_stage
        else "activation units, a rank's share of the model: stage activations / "
        f"{schedule.stages_per_rank} (JSON: peak_activation_units)"
    )
    print(f"(peak act: activations saved for backward, in {unit})")
    if args.trace:
        print(f"trace written to {args.trace}")
    return 0


def _json_default(value: Any) -> Any:
    """numpy scalars and other number-likes from pandas."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# vpipe compare

COMPARE_COLUMNS = (
    ("schedule", "schedule", "{}"),
    ("stages", "stages", "{}"),
    ("makespan", "makespan", "{:g}"),
    ("bubble", "bubble_ratio", "{:.3f}"),
    ("bubble excl. skew", "bubble_ratio_excl_skew", "{:.3f}"),
    ("peak act max", "peak_activation_units_max", "{:g}"),
    ("peak act min", "peak_activation_units_min", "{:g}"),
    ("comm ops", "comm_ops_total", "{}"),
    (f"step vs {REFERENCE_SCHEDULE}", "relative_step_time", "{:.3f}"),
)
# what the last column is: a step-time ratio, so that it is not read as the bench report's
# throughput ratio ("thru vs interleaved-1f1b", higher is better)
STEP_RATIO_NOTE = (
    f"step vs {REFERENCE_SCHEDULE}: makespan over {REFERENCE_SCHEDULE}'s, lower is faster"
)


def render_table(rows: list[dict[str, Any]]) -> str:
    """Aligned plain-text table; an error row shows its reason after the schedule name."""
    texts: list[list[str]] = []
    for row in rows:
        if "error" in row:
            texts.append([row["schedule"], f"cannot run: {row['error']}"])
            continue
        texts.append(
            [fmt.format(row[key]) if key in row else "n/a" for _, key, fmt in COMPARE_COLUMNS]
        )
    heads = [h for h, _, _ in COMPARE_COLUMNS]
    widths = [len(h) for h in heads]
    for t in texts:
        if len(t) == len(heads):
            widths = [max(w, len(c)) for w, c in zip(widths, t, strict=True)]
    widths[0] = max([widths[0], *(len(t[0]) for t in texts)])

    def line(cols: list[str]) -> str:
        if len(cols) != len(heads):  # error row: name, then the reason
            return f"{cols[0].ljust(widths[0])}  {cols[1]}"
        first = cols[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cols[1:], widths[1:], strict=True))
        return "  ".join([first, *rest])

    return "\n".join([line(heads), *(line(t) for t in texts)])


def _cmd_compare(args: argparse.Namespace) -> int:
    costs = _cost_model(args.cost)
    if args.schedules is None:
        names = list(schedule_names())
    else:
        names = [n.strip() for n in args.schedules.split(",")]
        if not all(names):
            raise ScheduleError(f"--schedules {shorten(args.schedules)}: empty schedule name")
        known = schedule_names()
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ScheduleError(
                f"unknown schedule {shorten(unknown[0])} in --schedules: choose from "
                + ", ".join(known)
            )
    rows = compare_rows(names, args.ranks, args.microbatches, costs, args.stages_per_rank)
    if args.json:
        out = {
            "ranks": args.ranks,
            "microbatches": args.microbatches,
            "cost": args.cost or UNIT_COST,
            "reference": REFERENCE_SCHEDULE,
            "note": COMPARE_NOTE,
            "schedules": rows,
        }
        print(json.dumps(out, default=_json_default))
        return 0
    print(
        f"{args.ranks} ranks, {args.microbatches} microbatches, cost {args.cost or UNIT_COST} "
        "(simulated; times in cost units)"
    )
    print(render_table(rows))
    print(f"({COMPARE_NOTE}; {STEP_RATIO_NOTE})")
    return 0
