"""Self-contained reports of benchmark sweeps: one HTML file (inline CSS, PNGs as data URIs,
nothing fetched from the network) and a Markdown summary, and their tables: the summary from
the runs table; A-vs-B ratios (V-schedules vs interleaved-1f1b, vpipe vs torch, one sweep vs
another: :mod:`vpipe.report.comparison`) with bootstrap intervals and verdicts from the timed steps
(:mod:`vpipe.stats`); the regime warning.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from vpipe.errors import VpipeError
from vpipe.metrics.catalogue import Metric, registry
from vpipe.metrics.per_run import PEAK_MEMORY_ORDER, SAVED_ACTIVATIONS
from vpipe.schedules import catalogue
from vpipe.stats import (
    CONFIDENCE,
    MIN_SAMPLES,
    OUTLIER_FACTOR,
    RESAMPLES,
    SEED,
    Ratio,
    paired_ratio,
)

BASELINE = catalogue.baseline()  # the family every other is compared with

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;
max-width:1200px;color:#222;line-height:1.4;padding:0 1em}
h1{font-size:1.6em}h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:.2em;
margin-top:1.6em}table{border-collapse:collapse;margin:.6em 0;font-size:.85em}
th,td{border:1px solid #ccc;padding:.25em .55em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.4em 0}.note{color:#555;font-size:.9em}
code{background:#f6f6f6;padding:0 .2em}
"""


class ReportError(VpipeError, ValueError):
    """A run or store given to ``vpipe report`` cannot be read."""


@dataclass
class Section:
    """A heading with HTML and Markdown bodies, and images (title -> PNG bytes)."""

    title: str
    html: str = ""
    markdown: str = ""
    images: dict[str, bytes] = field(default_factory=dict)


def data_uri(png: bytes) -> str:
    """A PNG as a ``data:`` URI, so the HTML needs no side files."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def table_html(df: pd.DataFrame) -> str:
    return df.to_html(index=False, border=0, na_rep="", escape=True)


def table_markdown(df: pd.DataFrame) -> str:
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join("" if pd.isna(v) else str(v) for v in row) + " |")
    return "\n".join(lines)


def table_section(title: str, df: pd.DataFrame, note: str = "") -> Section:
    """A section holding one table (and an optional note)."""
    note_html = f'<p class="note">{html.escape(note)}</p>' if note else ""
    return Section(
        title, note_html + table_html(df), (note + "\n\n" if note else "") + table_markdown(df)
    )


def text_section(title: str, paragraphs: Sequence[str]) -> Section:
    """A section of plain paragraphs."""
    body = "".join(f"<p>{html.escape(p)}</p>" for p in paragraphs)
    return Section(title, body, "\n\n".join(paragraphs))


def render_html(title: str, sections: Sequence[Section]) -> str:
    """One self-contained HTML document."""
    body = [f"<h1>{html.escape(title)}</h1>"]
    for s in sections:
        body.append(f"<h2>{html.escape(s.title)}</h2>")
        body.append(s.html)
        for name, png in s.images.items():
            alt = html.escape(name)
            body.append(
                f'<figure><img alt="{alt}" src="{data_uri(png)}">'
                f"<figcaption>{alt}</figcaption></figure>"
            )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def render_markdown(title: str, sections: Sequence[Section], image_dir: str | None = None) -> str:
    """A Markdown summary; images are linked from ``image_dir`` when given."""
    out = [f"# {title}", ""]
    for s in sections:
        out += [f"## {s.title}", "", s.markdown, ""]
        if image_dir is not None:
            for name in s.images:
                out += [f"![{name}]({image_dir}/{slug(name)}.png)", ""]
    return "\n".join(out)


def slug(name: str) -> str:
    keep = [c if c.isalnum() else "-" for c in name.lower()]
    return "-".join(p for p in "".join(keep).split("-") if p)


# ---------------------------------------------------------------------------------------------
# Tables from a runs table


def _fmt(v: Any, digits: int = 2) -> str:
    return "" if v is None or pd.isna(v) else f"{v:.{digits}f}"


def _ratio(a: Any, b: Any) -> str:
    ok = a is not None and b is not None and pd.notna(a) and pd.notna(b) and b != 0
    return f"{a / b:.2f}" if ok else ""


def summary_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per config: the registry's table metrics (:mod:`vpipe.metrics.catalogue`: step time with its
    IQR, throughput, memory, ...), with ratios to the interleaved-1f1b config of the same
    implementation and microbatch count."""
    rows = []
    base = runs[runs["schedule"] == BASELINE].set_index(["impl", "microbatches"])
    order = {s: i for i, s in enumerate(catalogue.display_order(runs["schedule"].unique()))}
    d = runs.assign(_o=runs["schedule"].map(order)).sort_values(["microbatches", "impl", "_o"])
    shown = [m for m in registry() if m.show and m.show.table]
    for r in d.to_dict("records"):
        key = (r["impl"], r["microbatches"])
        b = base.loc[key].to_dict() if key in base.index else None
        row = {"M": r["microbatches"], "impl": r["impl"], "schedule": r["schedule"]}
        for group in _groups(shown):
            for m in group:
                row.update(_cells(m, r))
            for m in group:
                if m.show.baseline:
                    ratio = _ratio(r.get(m.name), b.get(m.name)) if b is not None else ""
                    row[f"{m.show.baseline} vs {BASELINE}"] = ratio
        rows.append(row)
    df = pd.DataFrame(rows)
    empty = [m.label for m in shown if m.show.optional and len(df) and (df[m.label] == "").all()]
    return memory_columns(df.drop(columns=empty), d)  # e.g. token counts only for token models


# Memory as labelled columns, one per kind measured (vpipe.metrics.per_run's kinds): what a
# schedule saves for backward, and, where measured (CUDA), the allocator's peak
MEMORY_COLUMNS = {SAVED_ACTIVATIONS: "saved activations MiB", "cuda_peak": "allocator peak MiB"}


def memory_columns(table: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """``table`` (one row per run of ``runs``, in order) with its one "peak MiB" column (the
    headline peak, whichever kind was measured first) replaced by a column per kind of
    :data:`MEMORY_COLUMNS` that ``runs`` measured."""
    headline = next(m.label for m in registry() if m.name == "peak_memory_bytes")
    if headline not in table.columns:
        return table
    at = list(table.columns).index(headline)
    table = table.drop(columns=headline)
    for kind, label in MEMORY_COLUMNS.items():
        col = f"peak_{kind}_bytes"
        if col in runs.columns and runs[col].notna().any():
            table.insert(at, label, [_fmt(v / 2**20) if pd.notna(v) else "" for v in runs[col]])
            at += 1
    return table


def memory_label(runs: pd.DataFrame) -> str:
    """What the runs' headline peak (``peak_memory_bytes``) measured, as a column label: the
    kind whose peak it equals in every run (a sweep's is its saved activations)."""
    for kind in PEAK_MEMORY_ORDER:
        col = f"peak_{kind}_bytes"
        if col in runs.columns and runs[col].notna().any():
            if (runs[col].astype(float) == runs["peak_memory_bytes"].astype(float)).all():
                return MEMORY_COLUMNS.get(kind, f"peak {kind.replace('_', ' ')} MiB")
    return "peak MiB"


def _groups(metrics: Sequence[Metric]) -> list[list[Metric]]:
    """Metrics grouped by their printout line, in order of first appearance."""
    groups: dict[str, list[Metric]] = {}
    for m in metrics:
        groups.setdefault(m.show.group or m.label, []).append(m)
    return list(groups.values())


def _cells(m: Metric, row: Mapping[str, Any]) -> dict[str, str]:
    """A metric's table cells in one row: its value, then its IQR when it has one."""
    sh = m.show
    cells = {m.label: _fmt(_scaled(row.get(m.name), sh.scale), sh.digits)}
    if sh.spread and sh.spread.table:
        q1, q3 = (_scaled(row.get(q), sh.scale) for q in (sh.spread.q1, sh.spread.q3))
        iqr = f"{_fmt(q1, sh.digits)}-{_fmt(q3, sh.digits)}"
        cells[sh.spread.label] = "" if _missing(q1) or _missing(q3) else iqr
    return cells


def _scaled(v: Any, scale: float) -> Any:
    return None if _missing(v) else v * scale


def _missing(v: Any) -> bool:
    return v is None or bool(pd.isna(v))


def vpipe_only_note(schedules: Sequence[str], impls: Sequence[str]) -> str:
    """Sentences naming the swept schedules torch has no class for (the sweep skipped their
    torch configs); empty when torch was not asked for or has them all."""
    if "torch" not in impls:
        return ""
    vpipe_only = catalogue.names(lambda f: f.torch_class is None)
    missing = [s for s in catalogue.display_order(schedules) if s in vpipe_only]
    return "".join(
        f" {s}: torch.distributed.pipelining has no class for it; vpipe only." for s in missing
    )


def failure_lines(runs: pd.DataFrame) -> list[str]:
    """``schedule M=m impl: failed: cause``, one line per config of a runs table whose status
    is ``failed`` (a torch config that could not run; its cause in the ``error`` column)."""
    failed = runs[runs["status"].fillna("") == "failed"] if "status" in runs else runs.iloc[:0]
    return [
        f"{r['schedule']} M={r['microbatches']} {r['impl']}: failed: {r.get('error', '')}"
        for r in failed.to_dict("records")
    ]


CONFIG = ["schedule", "microbatches", "impl"]
CI = f"{CONFIDENCE:.0%} CI"
OUTLIERS = "outliers (excluded)"


def config_times(steps: pd.DataFrame, schedule: str, m: int, impl: str) -> pd.Series:
    """One config's timed steps, indexed by (round, step)."""
    d = steps[(steps["schedule"] == schedule) & (steps["microbatches"] == m)]
    return d[d["impl"] == impl].set_index(["round", "step"])["step_time_s"]


def paired_configs(num: pd.Series, den: pd.Series) -> Ratio:
    """:func:`vpipe.stats.paired_ratio` of two configs' steps paired by (round, step)."""
    both = pd.concat([num.rename("a"), den.rename("b")], axis=1, join="inner")
    return paired_ratio(both["a"], both["b"])


def ratio_cells(label: str, r: Ratio, above: str, below: str) -> dict[str, Any]:
    """A ratio's cells: value, interval, verdict, samples used and outliers excluded."""
    return {
        label: _fmt(r.value),
        CI: r.interval_text(),
        "verdict": r.verdict(above, below),
        "pairs": r.n,
        OUTLIERS: r.outliers,
    }


STATS_NOTE = (
    f"Ratios are medians of pairwise ratios (pairs: same round and step index, measured back to "
    f"back) with a {CONFIDENCE:.0%} percentile-bootstrap interval ({RESAMPLES} resamples of the "
    f'pairs, seed {SEED}); "no significant difference" when it contains 1, no verdict under '
    f"{MIN_SAMPLES} pairs. Steps over {OUTLIER_FACTOR:g}x their config's median are outliers, "
    "counted and excluded (with their pair)."
)


def impl_table(steps: pd.DataFrame) -> pd.DataFrame:
    """vpipe vs torch per schedule and M: the median of pairwise step-time ratios torch/vpipe
    (pairs are the same round and step index, measured back to back), with its bootstrap
    interval and verdict (:mod:`vpipe.stats`)."""
    rows = []
    for (sched, m), d in steps.groupby(["schedule", "microbatches"], observed=True):
        r = paired_configs(config_times(d, sched, m, "torch"), config_times(d, sched, m, "vpipe"))
        if r.n == 0:
            continue
        cells = ratio_cells("torch/vpipe step time", r, "vpipe faster", "torch faster")
        rows.append({"schedule": sched, "M": m, **cells})
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    order = {s: i for i, s in enumerate(catalogue.display_order(df["schedule"].unique()))}
    return df.assign(_o=df["schedule"].map(order)).sort_values(["M", "_o"]).drop(columns="_o")


def v_vs_baseline(
    runs: pd.DataFrame, steps: pd.DataFrame, schedules: Sequence[str] | None = None
) -> pd.DataFrame:
    """Throughput and peak-memory ratios of ``schedules`` (default: the catalogue's families
    with V placement) to the baseline, interleaved-1f1b, of the same impl and M. The
    throughput ratio is the median of pairwise ratios of the timed ``steps`` (baseline step
    time / schedule step time, same round and step index) with its bootstrap interval."""
    if schedules is None:
        schedules = catalogue.names(lambda f: f.placement == "v")
    rows = []
    memory = memory_label(runs)
    for (impl, m), d in runs.groupby(["impl", "microbatches"], observed=True):
        d = d.set_index("schedule")
        if BASELINE not in d.index:
            continue
        b = d.loc[BASELINE]
        base_steps = config_times(steps, BASELINE, m, impl)
        for s in schedules:
            if s in d.index:
                r = d.loc[s]
                thru = paired_configs(base_steps, config_times(steps, s, m, impl))
                rows.append(
                    {
                        "impl": impl,
                        "M": m,
                        "schedule": s,
                        **ratio_cells("throughput ratio", thru, "faster", "slower"),
                        "peak memory ratio": _ratio(r.peak_memory_bytes, b.peak_memory_bytes),
                        "samples/s": _fmt(r.samples_per_s, 1),
                        f"{BASELINE} samples/s": _fmt(b.samples_per_s, 1),
                        memory: _fmt(r.peak_memory_bytes / 2**20),
                        f"{BASELINE} {memory}": _fmt(b.peak_memory_bytes / 2**20),
                    }
                )
    return pd.DataFrame(rows)


# Below this regime figure (compute per action / one message's send+recv cost), posting the
# messages alone costs over a tenth of the compute they accompany: as much as the 10-20%
# step-time differences between schedules' bubbles that a sweep ranks, so the ranking follows
# per-message overhead, which larger microbatches and real interconnects do not share.
REGIME_THRESHOLD = 10.0
OVERHEAD_BOUND = (
    "per-action overhead and communication dominate; the schedule ranking will not transfer to "
    "real hardware"
)


def regime_warning(runs: pd.DataFrame) -> str:
    """A warning in words when configs of a sweep are overhead-bound (their ``regime`` figure,
    :mod:`vpipe.metrics.catalogue`, is below :data:`REGIME_THRESHOLD`); empty otherwise."""
    figures = _regime_figures(runs)
    low = figures[figures < REGIME_THRESHOLD]
    if low.empty:
        return ""
    span = f"regime figure {low.min():.1f}-{low.max():.1f}"
    below = f"compute per action under {REGIME_THRESHOLD:g}x the cost of sending one message"
    if len(low) == len(figures):
        return f"Overhead-bound: every profiled config has {below} ({span}): {OVERHEAD_BOUND}."
    names = ", ".join(f"{s} M={m} {i}" for s, m, i in low.index)
    return (
        f"Overhead-bound: {len(low)} of {len(figures)} profiled configs ({names}) have {below} "
        f"({span}): for them, {OVERHEAD_BOUND}."
    )


def regime_section(runs: pd.DataFrame) -> Section | None:
    """The sweep's regime in words: the overhead-bound warning, or that it is compute-bound,
    and the profiler's own overhead; None when there is neither (a sweep without messages
    has no regime figure)."""
    figures = _regime_figures(runs)
    text = "" if figures.empty else regime_warning(runs) or (
        f"Compute-bound: every profiled config has compute per action at least "
        f"{REGIME_THRESHOLD:g}x the cost of sending one message (regime figure "
        f"{figures.min():.1f}-{figures.max():.1f})."
    )
    paragraphs = [p for p in (text, profiler_overhead(runs)) if p]
    return text_section("Regime", paragraphs) if paragraphs else None


def profiler_overhead(runs: pd.DataFrame) -> str:
    """The profiler's own cost in words: each config's profiled step over its timed median
    (calibration reads the profiled steps; predictions are judged against the timed ones);
    empty when the runs have no profiled steps."""
    if not {"profiled_step_time_s", "step_time_s"} <= set(runs.columns):
        return ""
    ratio = (runs["profiled_step_time_s"] / runs["step_time_s"]).dropna().astype(float)
    if ratio.empty:
        return ""
    clock = "device" if "cuda" in set(runs.get("device", pd.Series(dtype=str)).astype(str)) else "host"
    return (
        f"Profiler overhead: a profiled step took {ratio.median():.2f}x the timed median "
        f"(median over {len(ratio)} configs, {ratio.min():.2f}-{ratio.max():.2f}); calibration "
        f"reads the profiled steps' {clock} intervals, and predictions are judged against the "
        "timed steps."
    )


def _regime_figures(runs: pd.DataFrame) -> pd.Series:
    if "regime" not in runs.columns:
        return pd.Series(dtype=float)
    return runs.set_index(CONFIG)["regime"].dropna().astype(float)


def meta_table(meta: Mapping[str, Any]) -> pd.DataFrame:
    """The setup table: each recorded option under its label, with what it means where a
    word could be read two ways (:mod:`vpipe.report.glossary`)."""
    from vpipe.report.glossary import setup_rows

    items = [(k, v if isinstance(v, str) else json.dumps(v, default=str), means)
             for k, v, means in setup_rows(meta)]  # fmt: skip
    return pd.DataFrame(items, columns=["field", "value", "means"])
