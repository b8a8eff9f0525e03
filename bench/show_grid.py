"""``vpipe show`` over the catalogue: every family x P = 1..8 x M in {1, P, P+1, 2P, 2P+1, 3P},
as a time grid and as the lowered program, run in one process through the CLI's own entry
point; counts the calls that crash or refuse, and the grids that miss, repeat or reorder an
action of the schedule (each grid is read back and compared with the CSV the same call wrote).

Run: ``python -m bench.show_grid [--ranks 8] [--families zbv,auto]`` (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """``vpipe ARGV`` in this process: exit status, stdout, stderr (argparse's exits count)."""
    from vpipe.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def grid_rows(out: str) -> dict[int, list[str]]:
    """rank -> cells of an unwrapped ``vpipe show`` grid."""
    rows: dict[int, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("rank "):
            head, _, body = line.partition(" | ")
            rows[int(head.split()[1])] = body.split()
    return rows


def grid_problems(out: str, schedule, lowered: bool) -> list[str]:
    """What the grid printed in ``out`` gets wrong about ``schedule``: per rank, the actions it
    shows (``.`` idle and ``-`` continuation cells left out) against the schedule's compute
    actions in program order (every action with ``lowered``)."""
    from vpipe.commands._grid import label

    rows = grid_rows(out)
    problems = []
    for r, acts in enumerate(schedule.actions):
        want = [label(str(a)) for a in acts if lowered or a.is_compute]
        got = [c for c in rows.get(r, []) if c not in (".", "-")]
        if got != want:
            where = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
                         min(len(got), len(want)))  # fmt: skip
            problems.append(
                f"rank {r}: {len(got)} actions shown, {len(want)} in the schedule, first "
                f"difference at position {where}"
            )
    return problems


def sweep(ranks: int, families: Sequence[str]) -> dict[str, object]:
    """Every family x P x M x (grid, lowered): counts and the failing calls."""
    from vpipe.ir import Schedule

    calls = crashes = refusals = bad = 0
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        csv = str(Path(tmp) / "s.csv")
        for family in families:
            for p in range(1, ranks + 1):
                for m in sorted({1, p, p + 1, 2 * p, 2 * p + 1, 3 * p}):
                    for lowered in (False, True):
                        argv = ["show", family, "-p", str(p), "-m", str(m), "--width", "1000000",
                                "--csv", csv] + (["--lowered"] if lowered else [])  # fmt: skip
                        calls += 1
                        try:
                            rc, out, err = run_cli(argv)
                        except Exception as e:  # noqa: BLE001 - what the figure counts
                            crashes += 1
                            failures.append(f"{' '.join(argv[:6])}: crash {e!r}")
                            continue
                        if rc != 0:
                            refusals += 1
                            failures.append(f"{' '.join(argv[:6])}: refused: {err.strip()}")
                            continue
                        problems = grid_problems(out, Schedule.from_csv(csv), lowered)
                        if problems:
                            bad += 1
                            failures.append(f"{' '.join(argv[:6])}: {problems[0]}")
    return {"calls": calls, "crashes": crashes, "refusals": refusals, "bad_grids": bad,
            "failures": failures}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    from vpipe.schedules import catalogue

    ap = argparse.ArgumentParser(prog="python -m bench.show_grid", description=__doc__)
    ap.add_argument("--ranks", type=int, default=8, help="P = 1..RANKS (default 8)")
    ap.add_argument("--families", help="comma-separated (default: the whole catalogue)")
    args = ap.parse_args(argv)
    families = args.families.split(",") if args.families else list(catalogue.names())
    t0 = time.perf_counter()
    got = sweep(args.ranks, families)
    for line in got["failures"]:
        print(line)
    print(
        f"{got['calls']} calls ({len(families)} families x P = 1..{args.ranks} x M in "
        f"{{1, P, P+1, 2P, 2P+1, 3P}} x grid and --lowered): {got['crashes']} crashes, "
        f"{got['refusals']} refusals, {got['bad_grids']} grids with a missing, repeated or "
        f"reordered action; {time.perf_counter() - t0:.0f} s"
    )
    return 1 if got["crashes"] or got["bad_grids"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
