"""``vpipe runs STORE``: list the runs a results store (or a ``vpipe bench`` output) holds."""

from __future__ import annotations

import argparse

COLUMNS = ("run_id", "source", "impl", "schedule", "ranks", "microbatches", "model", "step_time_s",
           "profiled_step_time_s", "status")  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "runs",
        help="list the runs in a results store (ids to pass to vpipe analyze --run)",
        description="One line per run of the store's runs table: id, source, impl, schedule, "
        "ranks, microbatches, model, median step time of the timed steps (a simulated run's: "
        "its simulated step) and of the profiled steps, in seconds; blank where a run has none.",
    )
    p.add_argument("store", metavar="STORE", help="a results store or vpipe bench output")
    p.add_argument("--json", action="store_true", help="the rows as JSON")
    p.add_argument(
        "--upgrade",
        action="store_true",
        help="first rewrite files written by an older vpipe in the current schema",
    )
    p.set_defaults(func=runs_command)


def runs_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vpipe.errors import TraceError
    from vpipe.trace.store import Store

    if not (Path(args.store) / "runs").is_dir():
        raise TraceError(f"{args.store}: not a results store (no runs/ directory)")
    store = Store(args.store)
    if args.upgrade:
        print(f"upgraded {store.upgrade()} files in {args.store}")
    runs = store.runs()
    table = runs[[c for c in COLUMNS if c in runs.columns]]
    if args.json:
        print(table.to_json(orient="records"))
    else:
        print(table.astype("object").where(table.notna(), "").to_string(index=False))
        print(f"{len(table)} runs in {args.store}")
    return 0
