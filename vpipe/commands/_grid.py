"""A schedule as a text grid for ``vpipe show``: one row per rank, either its program in order
or its actions placed in unit time slots, coloured by action kind on a terminal."""

from __future__ import annotations

import math
import re
import sys
from typing import Any

from vpipe.ir import Schedule, format_action

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


def print_grid(text: str) -> None:
    """Colour on a terminal, plain text when piped or redirected."""
    if not sys.stdout.isatty():
        print(text)
        return
    from rich.console import Console

    Console(highlight=False, soft_wrap=True).print(styled_grid(text))


def label(name: str) -> str:
    """Compact cell text: ``(0F3;3B1)OVERLAP_F_B`` becomes ``0F3+3B1``."""
    m = re.fullmatch(r"\((.*)\)OVERLAP_F_B", name)
    return m.group(1).replace(";", "+") if m else name


def program_cells(schedule: Schedule) -> list[list[str]]:
    return [[label(format_action(a)) for a in acts] for acts in schedule.actions]


# The grid's time axis: one slot per F, I or W of one stage, whatever the stages per rank
# (a V schedule's stage is half a rank's share, so its actions are drawn at their own size).
SLOT_NOTE = (
    "one time slot per F, I or W of a stage (f=b=w=1 per stage, free comm; a full backward B "
    "takes 2 slots, an overlap F+B 3, - continues an action); . idle"
)


def timed_cells(schedule: Schedule) -> list[list[str]]:
    """One cell per time slot per rank (:data:`SLOT_NOTE`), from a simulation with every F, I
    and W of a stage costing one slot: the action's label in its first slot, ``-`` in the slots
    it continues, ``.`` where the rank is idle. Every duration is a whole number of slots, so
    each action has a slot of its own and a row lists its rank's actions in program order."""
    from vpipe.sim import CostModel, simulate
    from vpipe.sim.simulator import KIND_NAMES

    c = simulate(schedule, CostModel(unit="stage")).columns  # numpy only: no pandas here
    compute = c["kind"] < 4  # F, B, I, W parts (KIND_NAMES order)
    ranks, starts, ends = c["rank"][compute], c["start"][compute], c["end"][compute]
    parts = zip(
        c["stage"][compute].tolist(),
        c["kind"][compute].tolist(),
        c["microbatch"][compute].tolist(),
        strict=True,
    )
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
            first, last = int(spans[0][1]), int(spans[-1][2])
            if row[first] != "." or first != spans[0][1]:
                raise RuntimeError(f"rank {rank}: {action} has no whole time slot of its own")
            row[first] = label(str(action))
            for t in range(first + 1, last):
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
