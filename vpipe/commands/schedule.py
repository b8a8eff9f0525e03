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
import math
import re
import shutil
import sys
from collections.abc import Callable
from typing import Any

from vpipe.errors import ScheduleError, VpipeError
from vpipe.ir import Schedule, format_action
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
        type=_positive_int,
        metavar="N",
        help="wrap the grid at this many columns (default: terminal)",
    )

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

    p = _add(subparsers, "compare", "simulate several schedules side by side", _cmd_compare)
    p.add_argument("--ranks", "-p", type=_positive_int, default=4, metavar="P", help="default 4")
    p.add_argument(
        "--microbatches", "-m", type=_positive_int, default=8, metavar="M", help="default 8"
    )
    p.add_argument(
        "--stages-per-rank",
        "-v",
        type=_positive_int,
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
    p.add_argument("--ranks", "-p", type=_positive_int, metavar="P", help="pipeline ranks")
    p.add_argument("--microbatches", "-m", type=_positive_int, metavar="M", help="microbatches")
    p.add_argument(
        "--stages-per-rank",
        "-v",
        type=_positive_int,
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


def _positive_int(text: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


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
    schedule = load_schedule(args.source, args.ranks, args.microbatches, args.stages_per_rank)
    if args.lowered and not schedule.is_lowered:
        schedule = lower(schedule)
    if args.csv:
        out = schedule if args.lowered else schedule.compute_only()
        _write(args.csv, out.to_csv)
    width = args.width or shutil.get_terminal_size((120, 24)).columns
    print(f"{schedule.name}: {describe(schedule)}")
    if args.lowered:
        print("program order (one column per action, SEND/RECV included)")
        _print_grid(render_grid(_program_cells(schedule), width, header=False))
    else:
        print("time slots with f=b=w=1 and free comm (a full backward B takes 2 slots); . idle")
        cells = _timed_cells(schedule)
        # Plain actions set a uniform slot width; only overlap actions widen their slot.
        plain = max((len(c) for row in cells for c in row if "+" not in c), default=1)
        _print_grid(render_grid(cells, width, header=True, min_col_width=plain))
    return 0


def _write(path: str, writer: Callable[[str], object]) -> None:
    """Run ``writer(path)``; an unwritable path becomes a one-line error."""
    try:
        writer(path)
    except OSError as e:
        raise VpipeError(f"cannot write {path}: {e.strerror or e}") from None


GRID_STYLES = (  # later patterns win where they overlap
    (r"\b\d+F\d+\b", "green"),
    (r"\b\d+[BI]\d+\b", "cyan"),
    (r"\b\d+W\d+\b", "yellow"),
    (r"\b\d+(SEND|RECV)_[FB]\d+\b", "dim"),
    (r"\S+\+\S+", "magenta"),  # overlap actions
)


def styled_grid(text: str) -> Any:
    """The grid as a rich Text, coloured by action kind."""
    from rich.text import Text

    out = Text(text)
    for pattern, style in GRID_STYLES:
        out.highlight_regex(pattern, style)
    return out


def _print_grid(text: str) -> None:
    """Colour on a terminal, plain text when piped or redirected."""
    if not sys.stdout.isatty():
        print(text)
        return
    from rich.console import Console

    Console(highlight=False, soft_wrap=True).print(styled_grid(text))


def _label(name: str) -> str:
    """Compact cell text: ``(0F3;3B1)OVERLAP_F_B`` becomes ``0F3+3B1``."""
    m = re.fullmatch(r"\((.*)\)OVERLAP_F_B", name)
    return m.group(1).replace(";", "+") if m else name


def _program_cells(schedule: Schedule) -> list[list[str]]:
    return [[_label(format_action(a)) for a in acts] for acts in schedule.actions]


def _timed_cells(schedule: Schedule) -> list[list[str]]:
    """One cell per unit time slot per rank, from a unit-cost simulation: the action's label
    in its first slot, ``-`` in the slots it continues, ``.`` where the rank is idle."""
    from vpipe.sim import simulate
    from vpipe.sim.simulator import KIND_NAMES

    c = simulate(schedule, _cost_model(UNIT_COST)).columns  # numpy only: no pandas here
    compute = c["kind"] < 4  # F, B, I, W parts (KIND_NAMES order)
    ranks, starts, ends = c["rank"][compute], c["start"][compute], c["end"][compute]
    parts = zip(c["stage"][compute].tolist(), c["kind"][compute].tolist(), c["microbatch"][compute].tolist(), strict=True)
    keys = [(s, KIND_NAMES[k], m) for s, k, m in parts]
    slots = int(math.ceil(float(ends.max()))) if len(ends) else 0
    cells = [["."] * slots for _ in range(schedule.n_ranks)]
    # The columns list each rank's compute parts in program order (an overlap action's parts
    # back to back), so walking the program pairs every action with its times.
    for rank in range(schedule.n_ranks):
        mine = ranks == rank
        mine_keys = [k for k, m in zip(keys, mine.tolist(), strict=True) if m]
        timed = iter(zip(mine_keys, starts[mine].tolist(), ends[mine].tolist(), strict=True))
        row = cells[rank]
        for action in schedule.actions[rank]:
            if not action.is_compute:
                continue
            spans = [next(timed) for _ in action.compute_parts()]
            want = [(p.stage, p.kind.value, p.microbatch) for p in action.compute_parts()]
            if [key for key, _, _ in spans] != want:
                raise RuntimeError(f"simulator timeline out of program order at {action}")
            first, last = round(spans[0][1]), round(spans[-1][2])
            row[first] = _label(str(action))
            for t in range(first + 1, max(last, first + 1)):
                row[t] = "-"
    return cells


def render_grid(cells: list[list[str]], width: int, *, header: bool, min_col_width: int = 1) -> str:
    """Rank rows and aligned columns (each as wide as its widest cell, at least
    ``min_col_width``), wrapped into blocks that fit ``width`` characters. With ``header`` a
    line above each block marks its first and every fifth column with the column index."""
    ncols = max(map(len, cells), default=0)
    col_width = [
        max(min_col_width, *(len(row[t]) for row in cells if t < len(row))) for t in range(ncols)
    ]
    prefix = len(f"rank {len(cells) - 1}") + 3
    blocks: list[tuple[int, int]] = []
    lo, used = 0, prefix
    for t, w in enumerate(col_width):
        if t > lo and used + w > width:
            blocks.append((lo, t))
            lo, used = t, prefix
        used += w + 1
    blocks.append((lo, ncols))
    lines: list[str] = []
    for lo, hi in blocks:
        if lines:
            lines.append("")
        if header:
            marks, offset = "", 0
            for t in range(lo, hi):
                if t == lo or (t % 5 == 0 and len(marks) < offset):
                    marks = marks.ljust(offset) + str(t)
                offset += col_width[t] + 1
            lines.append(" " * prefix + marks)
        for r, row in enumerate(cells):
            body = " ".join(c.ljust(col_width[t]) for t, c in enumerate(row[lo:hi], start=lo))
            lines.append(f"rank {r}".ljust(prefix - 3) + " | " + body.rstrip())
    return "\n".join(lines)


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
    """The JSON-ready result: the simulator's own dict plus the keys the CLI promises."""
    out = dict(result.to_dict())
    out.update(
        makespan=float(result.makespan),
        bubble_ratio=float(result.bubble_ratio),
        bubble_ratio_per_rank=[float(x) for x in result.bubble_ratio_per_rank],
        peak_activations=[int(x) for x in result.peak_activations],
        comm_ops=[int(x) for x in result.comm_ops],
    )
    return out


def _cmd_simulate(args: argparse.Namespace) -> int:
    from vpipe.sim import simulate

    costs = _cost_model(args.cost)
    if args.trace:
        check_output_file(args.trace, "--trace")
    schedule = load_schedule(args.source, args.ranks, args.microbatches, args.stages_per_rank)
    result = simulate(schedule, costs)
    if args.trace:
        _write(args.trace, result.to_chrome_trace)
    if args.json:
        summary = {"schedule": schedule.name, **simulation_summary(result)}
        print(json.dumps(summary, default=_json_default))
        return 0
    print(f"{schedule.name}: {describe(schedule)}; cost {args.cost or UNIT_COST} ({per(costs)})")
    print(f"makespan       {result.makespan:g}")
    print(
        f"bubble ratio   {result.bubble_ratio:.3f} whole step, "
        f"{result.bubble_ratio_excl_skew:.3f} excluding start-up skew"
    )
    # Peak saved activations in the cost string's unit: stages, or rank shares (as compare).
    v = 1 if costs.unit == "stage" else schedule.stages_per_rank
    header = f"{'rank':>4}  {'bubble':>6}  {'excl. skew':>10}  {'peak act':>8}  {'comm ops':>8}"
    print(header)
    for r in range(schedule.n_ranks):
        print(
            f"{r:>4}  {result.bubble_ratio_per_rank[r]:>6.3f}  "
            f"{result.bubble_ratio_per_rank_excl_skew[r]:>10.3f}  "
            f"{result.peak_activations[r] / v:>8g}  {result.comm_ops[r]:>8}"
        )
    unit = "stage activations" if v == 1 else f"rank shares (stage activations / {v})"
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
    ("peak act max", "peak_act_max", "{:g}"),
    ("peak act min", "peak_act_min", "{:g}"),
    ("comm ops", "comm_ops_total", "{}"),
    (f"vs {REFERENCE_SCHEDULE}", "relative_step_time", "{:.3f}"),
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
    print(f"({COMPARE_NOTE})")
    return 0
