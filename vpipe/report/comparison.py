"""Comparing sweeps across commits or machines (``vpipe report``): each sweep's runs table
and, from a ``vpipe bench`` output directory, its timed steps (``steps.parquet``), host state
(``host.parquet``) and meta; the ratio of step times per config, normalised by the host-speed
reference where both sweeps have one, with an interval that includes run-to-run variance and a
verdict that can be "within noise", "inconclusive" or "host differed"
(:mod:`vpipe.report.crossrun`, :mod:`vpipe.report.crossrun_table`), called a speedup only when the setups
match; one document with that table, headed by its one-line verdict, or, for one sweep, its
summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import nan
from pathlib import Path

import pandas as pd

from vpipe.errors import VpipeError
from vpipe.report.crossrun_table import (
    RunToRun,
    choose_normalisation,
    comparison_note,
    config_blocks,
    cross_cells,
    device_summary,
    headline,
    host_summary,
    host_unknown,
    run_to_run_sd,
)
from vpipe.report.document import (
    CONFIG,
    OUTLIERS,
    ReportError,
    Section,
    ratio_cells,
    regime_warning,
    render_html,
    render_markdown,
    summary_table,
    table_section,
    text_section,
)
from vpipe.report.knobs import knob_differences, knob_text
from vpipe.schedules.catalogue import display_order
from vpipe.stats import Ratio
from vpipe.trace.device_state import judge_devices
from vpipe.trace.host_state import judge_hosts


def run_label(runs: pd.DataFrame, fallback: str) -> str:
    """A short label for one sweep: commit and host when recorded."""
    parts = []
    for col in ("commit", "host"):
        if col in runs.columns and runs[col].notna().any():
            parts.append(str(runs[col].dropna().iloc[0])[:12])
    return "@".join(parts) or fallback


@dataclass
class Sweep:
    """One sweep to compare: a label, its measured runs-table rows and its timed steps (None
    when only the runs table is at hand)."""

    label: str
    runs: pd.DataFrame
    steps: pd.DataFrame | None = None
    host: pd.DataFrame | None = None  # host state per round (newer sweeps)
    meta: dict | None = None  # the output directory's meta.json

    def meta_value(self, key: str, default: object = None) -> object:
        return (self.meta or {}).get(key, default)


# What must match for a ratio of step times between two sweeps to be the code's speedup: the
# machine (host, torch, threads) and the workload (a smaller model is no faster code).
SETUP = {
    "host": "host",
    "torch": "torch version",
    "threads": "threads per rank",
    "device": "device",
    "backend": "backend",
    "ranks": "ranks",
    "model": "model",
    "sizes": "model sizes",
    "batch": "batch",
    "dp": "data-parallel replicas",
}
# Settings a sweep leaves out of its runs table at their default (a pipeline-only sweep
# records no "dp"), so older sweeps compare as what they were.
DEFAULTS = {"dp": "1"}


def setting(runs: pd.DataFrame, column: str) -> str | None:
    """A sweep's distinct values of a runs-table column, joined; None when not recorded."""
    values = runs[column].dropna() if column in runs.columns else pd.Series(dtype=object)
    return ",".join(sorted({str(v) for v in values})) or DEFAULTS.get(column)


def setup_differences(base: Sweep, run: Sweep) -> list[str]:
    """In words, what of :data:`SETUP` differs between two sweeps or is not recorded."""
    out = []
    for column, words in SETUP.items():
        a, b = setting(base.runs, column), setting(run.runs, column)
        if a is None or b is None:
            missing = " and ".join(s.label for s, v in ((base, a), (run, b)) if v is None)
            out.append(f"{words} not recorded for {missing}")
        elif a != b:
            out.append(f"{words} differs: {a} vs {b}")
    return out


def setup_note(sweeps: Sequence[Sweep]) -> str:
    """In words, what differs between the first sweep's setup and each other's (prefixed by
    the sweep's label when there are several); empty when every setup matches."""
    diffs = [(s.label, d) for s in sweeps[1:] if (d := setup_differences(sweeps[0], s))]
    if len(sweeps) == 2 and diffs:
        return "; ".join(diffs[0][1])
    return "; ".join(f"{label}: " + ", ".join(d) for label, d in diffs)


def ratio_label(sweeps: Sequence[Sweep]) -> str:
    """The ratio column's header: "speedup" when every run's setup matches the first's, else
    "ratio (not a speedup: ...)" saying what differs."""
    words = setup_note(sweeps)
    return f"ratio (not a speedup: {words})" if words else "speedup"


@dataclass(frozen=True)
class CrossModel:
    """How a comparison's sweeps are compared, decided once for its table and its note: why
    normalisation is unavailable (empty when it is), whether figures are normalised and why,
    and the launch-to-launch spread."""

    notes: frozenset[str]
    normalise: bool
    why: str
    spread: RunToRun


def on_gpu(sweeps: Sequence[Sweep]) -> bool:
    """Whether every sweep ran on GPUs (its step times are the device's)."""
    return all(setting(s.runs, "device") == "cuda" for s in sweeps)


def cross_model(sweeps: Sequence[Sweep]) -> CrossModel:
    """The :class:`CrossModel` of ``sweeps`` (the first is the base). On GPUs the figures are
    raw (the device's time by CUDA events), and the device's reference and state judge it."""
    notes = frozenset(n for s in sweeps[1:] if (n := normalisation_note(sweeps[0], s)))
    steps = [s.steps for s in sweeps]
    if on_gpu(sweeps):
        why = "raw GPU step times (CUDA events); the device reference and NVML state judge the device"
        return CrossModel(notes, False, why, run_to_run_sd(steps, False))
    normalise, why = choose_normalisation(steps, not notes)
    return CrossModel(notes, normalise, why, run_to_run_sd(steps, normalise))


def comparison_table(sweeps: Sequence[Sweep], model: CrossModel | None = None) -> pd.DataFrame:
    """Base step time over each sweep's, per (schedule, M, impl) present in both (the first
    sweep is the base): the ratio of median step times with a bootstrap interval resampling
    each sweep's steps of the config independently (:func:`vpipe.stats.ratio_of_medians`).

    The ms columns are the runs tables' medians. A sweep without steps gets their ratio and no
    interval. A sweep whose :data:`SETUP` (host, torch, threads, workload) differs from the
    base's or is not recorded gets no verdict: the ratio is then no speedup of the code, and the
    column's header says what differs.
    """
    if len(sweeps) < 2:
        raise ReportError("a comparison needs at least two runs")
    base = sweeps[0]
    label = ratio_label(sweeps)
    b = base.runs.set_index(CONFIG)
    model = model or cross_model(sweeps)
    rows = []
    for run in sweeps[1:]:
        r = run.runs.set_index(CONFIG)
        comparable = not setup_differences(base, run)
        timed = base.steps is not None and run.steps is not None
        if on_gpu([base, run]):  # the device decides; the CPU's state only describes the host
            summaries = device_summary(base.host), device_summary(run.host)
            hosts = judge_devices(*summaries)
            lacking = [s.label for s, h in zip((base, run), summaries, strict=True) if not h]
            unknown = f"no device state recorded for {' and '.join(lacking)}" if lacking else ""
        else:
            summaries = host_summary(base.host, base.steps), host_summary(run.host, run.steps)
            hosts = judge_hosts(*summaries)
            unknown = host_unknown(*summaries, (base.label, run.label))
        shared = b.index.intersection(r.index)
        for idx in shared:
            x, y = b.loc[idx], r.loc[idx]
            if timed:
                cells = cross_cells(
                    label,
                    config_blocks(base.steps, *idx),
                    config_blocks(run.steps, *idx),
                    normalise=model.normalise,
                    spread=model.spread,
                    host_differences=hosts,
                    rounds=int(run.meta_value("rounds", 3)),
                    configs=len(shared),
                    host_unknown=unknown,
                    ab_hint=ab_hint(base, run),
                )
                cells.pop("_ratio")
                if cells["verdict"] == "host differed" and on_gpu([base, run]):
                    cells["verdict"] = "device differed"
                cells["host"] = "; ".join(hosts) if cells["verdict"].endswith("differed") else unknown
            else:  # the runs tables' medians, timed against timed or profiled against profiled
                same_kind = pd.notna(x.get("step_time_s")) == pd.notna(y.get("step_time_s"))
                value = _recorded_step(x) / _recorded_step(y) if same_kind else nan
                ratio = Ratio(value, nan, nan, 0, 0)
                cells = ratio_cells(label, ratio, "faster", "slower")
                cells["steps"] = cells.pop("pairs")
            if not timed:
                cells.update({"verdict": "no interval: runs table only", OUTLIERS: "", "steps": ""})
                cells["to settle"] = (
                    f"compare vpipe bench output directories (their steps.parquet), or "
                    f"{ab_hint(base, run)}"
                )
            if not comparable:
                cells["verdict"] = "not comparable: setup differs"
                cells["to settle"] = "nothing: the ratio measures the setup (see the header)"
            rows.append(
                {
                    "schedule": idx[0],
                    "M": idx[1],
                    "impl": idx[2],
                    "run": run.label,
                    f"{base.label} ms": _ms(_recorded_step(x)),
                    "run ms": _ms(_recorded_step(y)),
                    "injected delay": _delay(run),
                    **cells,
                }
            )
    if not rows:
        raise ReportError(
            f"the runs share no (schedule, microbatches, impl) config with {base.label}"
        )
    df = pd.DataFrame(rows)
    order = {x: i for i, x in enumerate(display_order(df["schedule"].unique()))}
    df = df.assign(_o=df["schedule"].map(order)).sort_values(["run", "M", "impl", "_o"])
    return df.drop(columns="_o").reset_index(drop=True)


def ab_hint(base: Sweep, run: Sweep) -> str:
    """The ``vpipe ab`` command that compares two sweeps' versions in the same stretch of time
    (their commits where recorded)."""
    a, b = (setting(s.runs, "commit") or "A" for s in (base, run))
    return f"vpipe ab {a} {b} [same options]"


def steps_per_config(steps: pd.DataFrame | None) -> str:
    """A sweep's timed steps per config (all blocks), as the comparison table counts them."""
    if steps is None:
        return "none: runs table only"
    n = steps.groupby(["schedule", "microbatches", "impl"], observed=True).size()
    low, high = int(n.min()), int(n.max())
    return f"{low}" if low == high else f"{low}-{high}"


def _delay(sweep: Sweep) -> str:
    """The delay injected per step in a sweep (``vpipe bench --inject-delay-ms``, in ms, and
    ``--inject-delay-pct``, in % of the step), if any."""
    ms = float(sweep.meta_value("inject_delay_ms", 0.0) or 0.0)
    pct = float(sweep.meta_value("inject_delay_pct", 0.0) or 0.0)
    return " + ".join(([f"{ms:g} ms"] if ms else []) + ([f"{pct:g}% of the step"] if pct else []))


def normalisation_note(base: Sweep, run: Sweep) -> str | None:
    """Why two sweeps' step times cannot be normalised by the host-speed reference (an
    older sweep without reference timings, or different reference workloads); None when they
    can."""
    lacking = [
        s.label
        for s in (base, run)
        if s.steps is None or "ref_s" not in s.steps.columns or s.steps["ref_s"].isna().any()
    ]
    if lacking:
        return (
            f"normalisation unavailable: no reference timings in {' and '.join(lacking)} (sweeps "
            "from before vpipe timed a host-speed reference); raw step times are compared"
        )
    if base.meta_value("reference") != run.meta_value("reference"):
        return "normalisation unavailable: the sweeps timed different reference workloads"
    return None


def _recorded_step(row: pd.Series) -> float:
    """A run's step time: its timed median, or, for a run with profiled steps only (converted
    from traces), theirs (a comparison sets one kind against the same kind only)."""
    timed = row.get("step_time_s")
    return timed if pd.notna(timed) else row.get("profiled_step_time_s", nan)


def _ms(seconds: float) -> str:
    return "" if pd.isna(seconds) else f"{seconds * 1e3:.2f}"


RUNS_COLUMNS = ("schedule", "microbatches", "impl")  # memory: only where the run recorded it
# a runs table needs one of these: timed steps (a sweep's), or profiled ones alone (traces)
STEP_COLUMNS = ("step_time_s", "profiled_step_time_s")


def load_runs(path: str | Path) -> pd.DataFrame:
    """Measured rows of the runs table of a ``vpipe bench`` output directory or results store,
    or of a runs Parquet file (not those of torch configs that failed to run)."""
    from vpipe.trace.store import Store, runs_frame

    p = Path(path)
    try:
        if p.is_file():
            df = runs_frame(pd.read_parquet(p))
        elif (p / "runs").is_dir():
            df = Store(p).runs()
        else:
            raise ReportError(f"{p}: not a vpipe bench output or results store (no runs table)")
    except VpipeError:
        raise
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise ReportError(f"{p}: cannot read runs table: {e}") from None
    if df.empty:
        raise ReportError(f"{p}: the runs table is empty")
    missing = [c for c in RUNS_COLUMNS if df[c].isna().all()] if len(df) else []
    if all(df[c].isna().all() for c in STEP_COLUMNS):
        missing.append(" or ".join(STEP_COLUMNS))
    if missing:
        raise ReportError(f"{p}: runs table has no values for {missing}")
    ran = df["status"].fillna("ok") != "failed"  # a torch config that could not run has no figures
    return df[(df["source"].fillna("measured") == "measured") & ran].reset_index(drop=True)


def load_steps(path: str | Path) -> tuple[pd.DataFrame | None, str | None]:
    """The timed steps of a ``vpipe bench`` output directory (its ``steps.parquet``) and the
    sweep (``bench_id``) they belong to; (None, None) where there are none (a runs file)."""
    from vpipe.trace.store import read_parquet

    f = Path(path) / "steps.parquet"
    if not f.is_file():
        return None, None
    steps, meta = read_parquet(f)
    return steps, meta.get("bench_id")


def load_host(path: str | Path) -> tuple[pd.DataFrame | None, dict | None]:
    """A ``vpipe bench`` output directory's host state per round (``host.parquet``) and its
    ``meta.json``; None for either that is absent (older sweeps)."""
    import json

    from vpipe.trace.store import read_parquet

    p = Path(path)
    host = read_parquet(p / "host.parquet")[0] if (p / "host.parquet").is_file() else None
    meta = None
    if (p / "meta.json").is_file():
        try:
            meta = json.loads((p / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise ReportError(f"{p / 'meta.json'}: unreadable: {e}") from None
    return host, meta


def load_sweeps(paths: Sequence[str | Path]) -> list[Sweep]:
    """The sweeps of several runs tables (a store holding several is split by ``bench_id``),
    each with its timed steps when its directory has them."""
    sweeps: list[Sweep] = []
    for p in paths:
        runs = load_runs(p)
        steps, steps_id = load_steps(p)
        groups = list(
            runs.groupby("bench_id", sort=True) if "bench_id" in runs.columns else [(None, runs)]
        )
        for bench_id, d in groups:
            label = run_label(d, str(bench_id or Path(p).name))
            if any(label == s.label for s in sweeps):
                label = f"{label}#{len(sweeps)}"
            unnamed = (steps_id is None or bench_id is None) and len(groups) == 1
            own = steps if steps_id == bench_id or unnamed else None
            host, meta = load_host(p) if own is not None else (None, None)
            sweeps.append(Sweep(label, d, own, host, meta))
    return sweeps


def comparison_report(
    paths: Sequence[str | Path], extra: Sequence[Section] = ()
) -> tuple[str, str]:
    """HTML and Markdown comparing several runs (first = baseline); with several, the first
    section is the one-line verdict (:func:`vpipe.report.crossrun_table.headline`). ``extra``
    sections go last (one sweep's fidelity and plan, made by the caller)."""
    sweeps = load_sweeps(paths)
    runs_table = pd.DataFrame(
        [
            {
                "label": s.label,
                "configs": len(s.runs),
                "bench_id": s.runs["bench_id"].iloc[0] if "bench_id" in s.runs.columns else "",
                **{col: setting(s.runs, col) or "" for col in SETUP},
                "timed steps per config": steps_per_config(s.steps),
                "runtime knobs": knob_text(s.meta),
            }
            for s in sweeps
        ]
    )
    sections = [table_section("Runs", runs_table)]
    warnings = [f"{s.label}: {w}" for s in sweeps if (w := regime_warning(s.runs))]
    if warnings:
        sections.insert(0, text_section("Regime", warnings))
    if len(sweeps) == 1:
        sections.append(table_section("Summary", summary_table(sweeps[0].runs)))
    else:
        differs = setup_note(sweeps)
        title = "Step-time ratio (not a speedup)" if differs else "Speedup"
        model = cross_model(sweeps)
        table = comparison_table(sweeps, model)
        line = headline(table, sweeps[0].label, ratio_label(sweeps))
        knobs = knob_differences([s.meta for s in sweeps], [s.label for s in sweeps])
        if knobs:  # what a comparison of two knob settings compares
            line += " (runtime knobs differ: " + "; ".join(knobs) + ")"
        sections.insert(0, text_section("Verdict", [line]))
        sections.append(table_section("Host", host_table(sweeps), HOST_NOTE))
        sections.append(
            table_section(
                f"{title} over {sweeps[0].label}",
                table,
                _comparison_note(sweeps, differs, model),
            )
        )
    sections.extend(extra)
    title = "vpipe benchmark comparison"
    return render_html(title, sections), render_markdown(title, sections)


HOST_NOTE = (
    "Each sweep's host while it ran (median over its rounds): cores other processes kept busy, "
    "CPU steal, 1-minute load, CPU MHz, the host-speed reference's time; blocks and the delay "
    "injected per step (a known slowdown, not a workload difference). Empty: not recorded "
    "(an older sweep)."
)


def host_table(sweeps: Sequence[Sweep]) -> pd.DataFrame:
    """One row per sweep: its host state (:func:`vpipe.report.crossrun_table.host_summary`)."""
    rows = []
    for s in sweeps:
        h = host_summary(s.host, s.steps)
        rows.append(
            {
                "label": s.label,
                "other cores": _num(h["other_cores"], "{:.2f}"),
                "steal": _num(h["steal"], "{:.1%}"),
                "load": _num(h["load1"], "{:.2f}"),
                "MHz": _num(h["mhz"], "{:.0f}"),
                "reference ms": _num(h["ref_s"] and h["ref_s"] * 1e3, "{:.3f}"),
                "blocks": s.meta_value("blocks", 1),
                "injected delay": _delay(s),
            }
        )
    return pd.DataFrame(rows)


def _num(v: float | None, fmt: str) -> str:
    return "" if v is None else fmt.format(v)


def _comparison_note(sweeps: Sequence[Sweep], differs: str, model: CrossModel) -> str:
    """What the comparison table's figures mean, and why they are no speedup if so."""
    bare = [s.label for s in sweeps if s.steps is None]
    return comparison_note(differs, model.notes, model.why, model.spread, bare)
