"""``vpipe trace`` (Kineto JSON -> Parquet event table) and ``vpipe analyze`` (metrics of a
measured run, and simulator predictions calibrated from it, side by side with the error)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from vpipe.errors import TraceError

PIPELINE_HELP = (
    "which pipeline to read, of traces that hold several (a data- or tensor-parallel job: one "
    "file per global rank); 0, the default, is the one holding the lowest global rank"
)


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
    p.add_argument("--pipeline", type=int, metavar="K", help=PIPELINE_HELP)
    p.add_argument(
        "--csv",
        metavar="FILE",
        help="write the program the trace ran (each rank's compute actions) as a schedule CSV",
    )
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
        action="extend",
        default=[],
        metavar="SCHEDULE[=TRACE]",
        help="schedules to predict; measured counterpart from the store or the given trace",
    )
    a.add_argument("--batch", type=int, help="samples per step (default: from the run's metadata)")
    a.add_argument("--pipeline", type=int, metavar="K", help=PIPELINE_HELP)
    a.add_argument(
        "--microbatches",
        type=int,
        help="microbatches per step, where the trace does not say them (default: from the run)",
    )
    a.add_argument(
        "--w-share",
        type=float,
        default=0.5,
        help="W's assumed share of a B when the run has no I/W spans (default 0.5)",
    )
    a.add_argument(
        "--stat",
        choices=("median", "mean"),
        default="median",
        help="per stage and kind statistic of span durations to calibrate with (default median)",
    )
    a.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    a.add_argument(
        "--fidelity",
        action="store_true",
        help="for every sweep in the store: calibrate on each profiled config, predict every "
        "config, errors against the timed medians (the bench report's fidelity tables)",
    )
    a.set_defaults(func=analyze_command)


def trace_command(args: argparse.Namespace) -> int:
    from vpipe.metrics.catalogue import summarize
    from vpipe.outputs import check_output_dir, check_output_file
    from vpipe.trace.kineto import convert
    from vpipe.trace.store import Store, meta_columns, write_parquet

    if not args.output and not args.store and not args.csv:
        raise TraceError("nothing to write: give -o OUT, --store ROOT and/or --csv FILE")
    if args.output:
        check_output_file(args.output, "-o")
        check_output_file(memory_path(Path(args.output)), "-o (memory table)")
    if args.store:
        check_output_dir(args.store, append=True, flag="--store")
    if args.csv:
        check_output_file(args.csv, "--csv")
    t0 = time.perf_counter()
    tr = convert(
        args.paths,
        run_id=args.run_id,
        impl=args.impl,
        schedule=args.schedule,
        pipeline=args.pipeline,
    )
    dt = time.perf_counter() - t0
    meta = {k: v for k, v in tr.meta.items()}
    if args.csv:
        if "program" not in meta:
            raise TraceError(
                "--csv: the trace names no actions on some rank, so its program is unknown"
            )
        Path(args.csv).write_text(meta["program"])
    if args.output:
        out = Path(args.output)
        write_parquet(tr.events, out, {"table": "events", **meta})
        write_parquet(tr.memory, memory_path(out), {"table": "memory", **meta})
    if args.store:
        batch = args.batch or meta.get("batch")
        row = {**meta_columns(meta), "source": "measured", "status": "ok"}
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
        + (f" -> program {args.csv}" if args.csv else "")
    )
    if meta.get("note"):
        print(f"note: {meta['note']}")
    return 0


def memory_path(events_path: Path) -> Path:
    """Where ``vpipe trace -o OUT`` puts the memory table: OUT with ``.memory.parquet``."""
    name = events_path.name.removesuffix(".parquet")
    return events_path.with_name(f"{name}.memory.parquet")


def analyze_command(args: argparse.Namespace) -> int:
    if args.fidelity:
        from vpipe.commands._analyze_fidelity import fidelity_text

        print(fidelity_text(args.source))
        return 0
    found = analyze(
        args.source,
        run=args.run,
        predict=args.predict,
        batch=args.batch,
        w_share=args.w_share,
        stat=args.stat,
        microbatches=args.microbatches,
        pipeline=args.pipeline,
    )
    print(analysis_json(found) if args.json else analysis_text(found))
    return 0


def _load(
    source: str, run: str | None, microbatches: int | None = None, pipeline: int | None = None
) -> tuple[Any, Any, dict]:
    """(events, memory, metadata) of one measured run from a store, trace or events file
    (``microbatches``: M of a trace that names no actions, to name its runs of operators;
    ``pipeline``: which of a trace's pipelines, :mod:`vpipe.trace.pipelines`)."""

    from vpipe.trace.kineto import convert
    from vpipe.trace.store import Store, read_parquet

    path = Path(source)
    if (path / "runs").is_dir():
        store = Store(path)
        runs = store.runs()
        if run is None:
            if len(runs) != 1:
                raise TraceError(
                    f"{path}: the store holds {len(runs)} runs: choose one with --run "
                    f"(vpipe runs {path} lists them)"
                )
            run = str(runs["run_id"].iloc[0])
        stored = store.run(run)
        return stored.events, stored.memory, stored.meta
    if path.suffix == ".parquet":
        events, meta = read_parquet(path)
        mem = memory_path(path)
        memory = read_parquet(mem)[0] if mem.exists() else None
        return events, memory, meta
    tr = convert([path], run_id=run, microbatches=microbatches, pipeline=pipeline)
    return tr.events, tr.memory, tr.meta


def _counterpart(source: str, meta: dict, schedule: str) -> tuple[Any, float | None]:
    """Measured events of ``schedule`` on the same config, from the same store (the same sweep
    when the run is a sweep's), and its timed median step time; (None, None) if none."""
    from vpipe.trace.store import Store

    path = Path(source)
    if not (path / "runs").is_dir():
        return None, None
    runs = Store(path).runs()
    same = (runs["schedule"] == schedule) & (runs["source"].fillna("measured") == "measured")
    for key in ("ranks", "microbatches", "model", "batch", "impl", "bench_id"):
        if key in meta and key in runs:
            same &= runs[key] == meta[key]
    if not same.any():
        return None, None
    from vpipe.predict.calibrate import timed_median_s

    row = runs[same].iloc[0]
    return Store(path).events([str(row["run_id"])]), timed_median_s(row)


def analyze(
    source: str,
    *,
    run: str | None,
    predict: list[str],
    batch: int | None = None,
    w_share: float = 0.5,
    stat: str = "median",
    microbatches: int | None = None,
    pipeline: int | None = None,
) -> dict[str, Any]:
    """Everything `vpipe analyze` reports about a run: its metrics, peaks, per-kind span
    medians and, with ``predict``, the calibration and the predictions (a trace of several
    pipelines: ``pipeline``'s, and the same one of each ``SCHEDULE=TRACE``)."""
    from vpipe.metrics.catalogue import summarize
    from vpipe.metrics.per_run import kind_durations, peak_memory

    if pipeline is not None and (Path(source) / "runs").is_dir():
        raise TraceError("--pipeline reads a trace of several pipelines, not a results store")
    events, memory, meta = _load(source, run, microbatches, pipeline)
    if microbatches:
        meta = {**meta, "microbatches": microbatches}
    batch = batch or _int(meta.get("batch"))
    tps = _int(meta.get("tokens_per_sample")) or _gpt_seq_len(meta)
    found: dict[str, Any] = {
        "run_id": str(meta.get("run_id") or (events["run_id"].iloc[0] if len(events) else "?")),
        "run": {k: meta[k] for k in RUN_FIELDS if k in meta},
        "metrics": _with_timed(
            summarize(events, memory, batch=batch, tokens_per_sample=tps, missing=None), meta
        ),
        "peak_bytes": dict(peak_memory(memory).max()) if memory is not None else {},
        "spans": kind_durations(events),
        "note": meta.get("note"),
    }
    if predict:
        found.update(_fidelity(source, events, meta, predict, w_share, stat, pipeline))
    return found


RUN_FIELDS = ("impl", "schedule", "ranks", "stages", "microbatches", "model", "batch")


def _with_timed(metrics: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """A run's metrics from its events, completed from its runs-table row where the events
    give none and the run has timed steps (a sweep's run): the figures of the timed steps
    (step time, throughput, the normalised step, the simulator's error), so that every name
    means what it means in ``vpipe runs``, the report and the runs table."""
    from vpipe.predict.calibrate import timed_median_s

    if timed_median_s(row) is None:
        return metrics
    out = dict(metrics)
    for name, value in metrics.items():
        stored = row.get(name)
        if value is None and stored is not None and stored == stored:
            out[name] = stored.item() if hasattr(stored, "item") else stored
    return out


def analyze_report(source: str, **kw: Any) -> str:
    """The text `vpipe analyze` prints."""
    return analysis_text(analyze(source, **kw))


def analysis_text(found: dict[str, Any]) -> str:
    """:func:`analyze`'s figures as the lines `vpipe analyze` prints."""
    s = found["metrics"]
    desc = ", ".join(f"{k} {v}" for k, v in found["run"].items())
    n = s["steps"]
    timed = "" if s.get("step_time_s") is None else (
        "; step time and throughput are the timed steps' (unprofiled), the rest the profiled "
        "steps'"
    )  # fmt: skip
    lines = [
        f"run {found['run_id']} ({desc}): {n} profiled step{'' if n == 1 else 's'} (recorded "
        f"under torch.profiler, which slows each step){timed}"
    ]
    lines.extend(metric_lines(s))
    if found.get("note"):
        lines.append(f"  note           {found['note']}")
    peaks = found["peak_bytes"]
    if len(peaks):
        lines.append(
            "  peak memory    " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in peaks.items())
        )
    kd = found["spans"]
    if not kd.empty:
        table = kd.pivot(index="stage", columns="kind", values="median_s") * 1e3
        lines.append("  median span (ms) per stage and kind (-: the stage ran none):")
        text = table.round(3).to_string(na_rep="-")
        lines.extend("    " + ln for ln in text.splitlines())
    if "predictions" in found:
        d, units = found["calibration"], found["model_pieces"]
        head = (
            f"calibrated on {d['run_id']} ({d['stat']}s): F {d['f_us']} us, I {d['i_us']} us, "
            f"W {d['w_us']} us per stage; posting {d['post_us']} us per send/recv, gap "
            f"{d['gap_us']} us per action; comm latency {d['comm_latency_us']} us, handshake "
            f"{d['comm_handshake_us']} us"
            + (
                f"; communication threads {d['comm_threads_us']} us per message posted"
                if d.get("comm_threads_us")
                else ""
            )
            + (f"; I/W split assumed (W = {d['w_share']} of B)" if d["w_share"] is not None else "")
            + (
                f"; a split backward: I + W = {d['split_ratio']}x B"
                if d.get("split_ratio")
                else "; I + W taken as B (no split probe)"
            )  # fmt: skip
            + (f"; model in {units} pieces" if units else "")
            + (
                f"; compute x{d['compute_scale']:.3f}, anchored to the run's {d['anchored_to']}"
                if d.get("anchored_to", "none") != "none"
                else "; the run's schedule is unknown: compute as profiled, not anchored"
            )
        )
        table = found["predictions"]
        shown = table.to_string(index=False, float_format=lambda x: f"{x:.3f}", na_rep="-")
        lines += ["", head, shown, f"predicted step times: {found['error_source']}"]
    return "\n".join(lines)


def analysis_json(found: dict[str, Any]) -> str:
    """:func:`analyze`'s figures as one JSON object (tables as lists of records)."""
    import pandas as pd

    def plain(v: Any) -> Any:
        if isinstance(v, pd.DataFrame):
            return [{k: plain(x) for k, x in r.items()} for r in v.to_dict("records")]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if hasattr(v, "item"):  # numpy scalars
            v = v.item()
        return None if isinstance(v, float) and v != v else v  # NaN -> null

    return json.dumps(plain(found))


def metric_lines(values: dict[str, Any]) -> list[str]:
    """The printout's lines of the registry's metrics (:mod:`vpipe.metrics.catalogue`) that apply to a
    run (not None), one line per group: ``  step time      12.345 ms median (IQR ...)``."""
    from vpipe.metrics.catalogue import registry

    groups: dict[str, list[str]] = {}
    for m in registry():
        sh, v = m.show, values.get(m.name)
        if sh is None or not sh.text or v is None:
            continue
        digits = sh.digits if sh.text_digits is None else sh.text_digits
        unit = f" {sh.unit}" if sh.unit else ""
        text = f"{v * sh.scale:.{digits}f}{unit}" + (f" {sh.note}" if sh.note else "")
        if sh.spread:
            q1, q3 = (values[q] * sh.scale for q in (sh.spread.q1, sh.spread.q3))
            text += f" (IQR {q1:.{digits}f}-{q3:.{digits}f}{unit})"
        groups.setdefault(sh.group or m.label, []).append(text)
    return [f"  {group:<14} {', '.join(texts)}" for group, texts in groups.items()]


def _fidelity(
    source: str,
    events: Any,
    meta: dict,
    predict: list[str],
    w_share: float,
    stat: str,
    pipeline: int | None = None,
) -> dict[str, Any]:
    from vpipe.metrics.per_run import step_metrics
    from vpipe.predict.calibrate import (
        anchor,
        calibrate,
        comm_thread_cpu_s,
        fidelity_table,
        model_units,
        timed_median_s,
    )
    from vpipe.predict.split_cost import split_backward_ratio
    from vpipe.schedules import make_schedule
    from vpipe.sweep.results import has_actions

    if not has_actions(events, named=True):
        raise TraceError(
            "--predict needs per-action costs, which this run does not hold: "
            + str(meta.get("note") or "it has no compute actions")
        )
    ranks, mbs = _int(meta.get("ranks")), _int(meta.get("microbatches"))
    if not ranks:
        raise TraceError("--predict needs the run's ranks: the trace does not say them")
    if not mbs:
        raise TraceError(
            "--predict needs the run's microbatches, which the trace does not name: "
            "give --microbatches M"
        )
    cal = calibrate(events, w_share=w_share, stat=stat, split_ratio=split_backward_ratio(meta))
    units = model_units(meta)
    cases = []
    own = str(meta.get("schedule", "unknown"))
    anchored_to = "none"
    if own not in ("unknown", "custom"):
        timed = timed_median_s(meta)
        schedule = make_schedule(own, ranks, mbs, _per_rank(meta, ranks))
        # its level: the timed median's, else its profiled steps' (a trace has no timed steps)
        level = timed or float(step_metrics(events[events["step"] >= 0])["step_time_s"].median())
        cal = anchor(cal, schedule, level, units, comm_thread_cpu_s=comm_thread_cpu_s(meta))
        anchored_to = "timed median" if timed else "profiled median"
        cases.append((f"{own} (calibration run)", schedule, events, timed))
    for item in predict:
        name, _, trace = item.partition("=")
        if name == own and not trace:
            continue  # the calibration run's own row above
        if trace:
            measured, _, other = _load(trace, None, pipeline=pipeline)
            timed, per_rank = None, _per_rank(other, ranks)
        else:
            (measured, timed), per_rank = _counterpart(source, meta, name), None
        cases.append((name, make_schedule(name, ranks, mbs, per_rank), measured, timed))
    table = fidelity_table(cal, cases, units, events, w_share=w_share, stat=stat)
    error = _sweep_error(source, meta)
    return {
        "calibration": {**cal.to_dict(), "stat": stat, "anchored_to": anchored_to},
        "model_pieces": units,
        "predictions": table,
        "error": error.value,
        "error_source": error.words(),
    }


def _per_rank(meta: dict, ranks: int) -> int | None:
    """Stages per rank of a run whose metadata (or trace) names its stages; None: the
    family's default."""
    stages = _int(meta.get("stages"))
    return stages // ranks if stages and stages % ranks == 0 else None


def _sweep_error(source: str, meta: dict) -> Any:
    """The error of predictions calibrated on this run, measured on its sweep's other
    profiled configs (:func:`vpipe.predict.fidelity_runs.store_errors`) when it is a stored
    sweep's run; else unknown."""
    from vpipe.predict.fidelity import unknown
    from vpipe.predict.fidelity_runs import store_errors

    if not (Path(source) / "runs").is_dir() or not meta.get("run_id"):
        return unknown("a single trace has no cross-config fidelity")
    return store_errors(source, str(meta["run_id"])).measured


def _gpt_seq_len(meta: dict) -> int | None:
    """Tokens per sample of a GPT run (its seq_len), else None."""
    if meta.get("model") != "gpt":
        return None
    sizes = meta.get("sizes") if isinstance(meta.get("sizes"), dict) else {}
    if "seq_len" in sizes:
        return _int(sizes["seq_len"])
    from vpipe.models import DEFAULT_SIZES

    return DEFAULT_SIZES["gpt"]["seq_len"]


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None
