"""``vpipe trace`` (Kineto JSON -> Parquet event table) and ``vpipe analyze`` (metrics of a
measured run, and simulator predictions calibrated from it, side by side with the error)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vpipe.errors import TraceError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trace",
        help="convert profiler traces (Kineto JSON) to the Parquet event table",
        description=(
            "Convert the per-rank Kineto JSON traces of one run (files or directories) to the "
            "vpipe event table. -o writes OUT (events) and OUT's .memory.parquet sibling (memory "
            "samples); --store appends the run, with its metrics, to a results store."
        ),
    )
    p.add_argument("paths", nargs="+", metavar="DIR_OR_FILES", help="trace files or directories")
    p.add_argument("-o", "--output", metavar="OUT", help="events Parquet file to write")
    p.add_argument("--store", metavar="ROOT", help="append the run to the results store at ROOT")
    p.add_argument("--run-id", help="run id (default: the trace's, else the directory name)")
    p.add_argument("--impl", help="implementation label (default: from the trace)")
    p.add_argument("--schedule", help="schedule name (default: from the trace)")
    p.add_argument("--batch", type=int, help="samples per step, for throughput in --store")
    p.set_defaults(func=trace_command)

    a = subparsers.add_parser(
        "analyze",
        help="metrics of a run; simulator predictions calibrated from it, with the error",
        description=(
            "Print a run's metrics (median and interquartile range over steps). With --predict, "
            "calibrate the simulator's cost model from the run and print each schedule's "
            "predicted figures next to its measured ones (from the store, or SCHEDULE=TRACE)."
        ),
    )
    a.add_argument(
        "source", metavar="STORE_OR_TRACE", help="results store, trace dir or events Parquet"
    )
    a.add_argument("--run", help="run id in the store (required when it holds several)")
    a.add_argument(
        "--predict",
        nargs="+",
        default=[],
        metavar="SCHEDULE[=TRACE]",
        help="schedules to predict; measured counterpart from the store or the given trace",
    )
    a.add_argument("--batch", type=int, help="samples per step (default: from the run's metadata)")
    a.set_defaults(func=analyze_command)


def trace_command(args: argparse.Namespace) -> int:
    from vpipe.analysis import summarize
    from vpipe.trace.kineto import convert
    from vpipe.trace.store import Store, write_parquet

    if not args.output and not args.store:
        raise TraceError("nothing to write: give -o OUT and/or --store ROOT")
    t0 = time.perf_counter()
    tr = convert(args.paths, run_id=args.run_id, impl=args.impl, schedule=args.schedule)
    dt = time.perf_counter() - t0
    meta = {k: v for k, v in tr.meta.items()}
    if args.output:
        out = Path(args.output)
        write_parquet(tr.events, out, {"table": "events", **meta})
        write_parquet(tr.memory, memory_path(out), {"table": "memory", **meta})
    if args.store:
        batch = args.batch or meta.get("batch")
        row = {**_run_columns(meta), "source": "measured", "status": "ok"}
        row.update(
            summarize(
                tr.events, tr.memory, batch=batch, tokens_per_sample=meta.get("tokens_per_sample")
            )
        )
        Store(args.store).append_run(row, tr.events, tr.memory)
    print(
        f"{tr.n_trace_events} trace events in {dt:.2f} s ({tr.n_trace_events / max(dt, 1e-9):,.0f}/s)"
        f" -> {len(tr.events)} event rows, {len(tr.memory)} memory rows, run {meta['run_id']}"
        + (f" -> {args.output}" if args.output else "")
        + (f" -> store {args.store}" if args.store else "")
    )
    return 0


def memory_path(events_path: Path) -> Path:
    """Where ``vpipe trace -o OUT`` puts the memory table: OUT with ``.memory.parquet``."""
    name = events_path.name.removesuffix(".parquet")
    return events_path.with_name(f"{name}.memory.parquet")


def _run_columns(meta: dict) -> dict:
    from vpipe.trace.store import RUN_COLUMNS

    out = {k: meta[k] for k in RUN_COLUMNS if k in meta}
    out["run_id"] = meta["run_id"]
    return out


def analyze_command(args: argparse.Namespace) -> int:
    from vpipe.calibrate import analyze_report

    print(analyze_report(args.source, run=args.run, predict=args.predict, batch=args.batch))
    return 0
