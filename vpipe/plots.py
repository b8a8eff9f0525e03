"""Plots of benchmark results (seaborn, rendered to PNG bytes without pyplot, so the caller's
matplotlib backend is never changed).

Every function takes plain DataFrames (the sweep's runs/steps tables, or event and memory
tables in the :mod:`vpipe.events` schema) and returns a matplotlib Figure, so reports can embed
them and tests can check them without a display.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from vpipe.events import COMPUTE_KINDS
from vpipe.schedules import catalogue

BASELINE = catalogue.baseline()
IMPL_ORDER = ("vpipe", "torch")

KIND_COLORS = {
    "F": "#4c72b0",
    "B": "#c44e52",
    "I": "#dd8452",
    "W": "#55a868",
    "SEND_F": "#8172b3",
    "RECV_F": "#8172b3",
    "SEND_B": "#937860",
    "RECV_B": "#937860",
    "WAIT": "#bbbbbb",
    "other": "#dddddd",
}


def schedule_order(names: Sequence[str]) -> list[str]:
    """Catalogued schedules in display order (baselines first), unknown ones after, sorted."""
    present = set(names)
    known = [s for s in catalogue.names() if s in present]
    return known + sorted(present - set(known))


def _impl_order(names: Sequence[str]) -> list[str]:
    present = set(names)
    return [i for i in IMPL_ORDER if i in present] + sorted(present - set(IMPL_ORDER))


def _subplots(nrows: int, ncols: int, **kw) -> tuple[Figure, Any]:
    """A figure and its axes without pyplot, so importing or plotting never changes the
    caller's matplotlib backend (a notebook keeps its own)."""
    figsize = kw.pop("figsize", None)
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **kw)


def to_png(fig: Figure, dpi: int = 80) -> bytes:
    """Render a figure to PNG bytes and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _facets(n: int, width: float = 5.0, height: float = 3.6) -> tuple[Figure, list]:
    fig, axes = _subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def plot_throughput(steps: pd.DataFrame) -> Figure:
    """Samples/s per schedule and implementation, one panel per microbatch count.

    Bars are medians over measured steps; error bars span the 25th-75th percentile. Each bar is
    labelled with its ratio to the interleaved-1f1b bar of the same implementation.
    """
    mbs = sorted(steps["microbatches"].unique())
    fig, axes = _facets(len(mbs))
    order = schedule_order(steps["schedule"].unique())
    impls = _impl_order(steps["impl"].unique())
    for ax, m in zip(axes, mbs, strict=True):
        d = steps[steps["microbatches"] == m]
        sns.barplot(
            data=d,
            x="schedule",
            y="samples_per_s",
            hue="impl",
            order=order,
            hue_order=impls,
            estimator="median",
            errorbar=("pi", 50),
            capsize=0.15,
            ax=ax,
        )
        med = d.groupby(["impl", "schedule"], observed=True)["samples_per_s"].median()
        for container, impl in zip(ax.containers, impls, strict=False):
            base = med.get((impl, BASELINE))
            # One bar per schedule this impl ran (a vpipe-only family has no torch bar).
            ran = [med[(impl, sched)] for sched in order if (impl, sched) in med]
            labels = [f"{v / base:.2f}x" if base else "" for v in ran]
            ax.bar_label(container, labels=labels, fontsize=7, padding=6)
        ax.margins(y=0.12)
        ax.legend(loc="lower right", fontsize=7, title="impl", title_fontsize=7)
        ax.set_title(f"M={m} (ratio vs {BASELINE})")
        ax.set_xlabel("")
        ax.set_ylabel("samples/s (median, IQR)")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("Throughput (higher is better)")
    fig.tight_layout()
    return fig


def plot_memory(ranks: pd.DataFrame, column: str = "peak_bytes") -> Figure:
    """Peak memory per schedule: bars are the maximum over ranks, dots each rank's peak."""
    mbs = sorted(ranks["microbatches"].unique())
    fig, axes = _facets(len(mbs))
    order = schedule_order(ranks["schedule"].unique())
    impls = _impl_order(ranks["impl"].unique())
    d_all = ranks.assign(MiB=ranks[column] / 2**20)
    for ax, m in zip(axes, mbs, strict=True):
        d = d_all[d_all["microbatches"] == m]
        common = dict(x="schedule", y="MiB", hue="impl", order=order, hue_order=impls, ax=ax)
        sns.barplot(data=d, estimator="max", errorbar=None, alpha=0.8, **common)
        sns.stripplot(data=d, dodge=True, palette="dark:black", size=3, legend=False, **common)
        ax.set_title(f"M={m}")
        ax.set_xlabel("")
        ax.set_ylabel("peak activation MiB (max over ranks; dots: ranks)")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("Peak memory (lower is better)")
    fig.tight_layout()
    return fig


def _gantt(ax, events: pd.DataFrame, title: str, unit: str = "ms") -> None:
    scale = {"ms": 1e6, "us": 1e3}[unit]
    t0 = events["start_ns"].min() if len(events) else 0
    n_ranks = int(events["rank"].max()) + 1 if len(events) else 1
    for kind, grp in events.groupby("kind", observed=True):
        color = KIND_COLORS.get(str(kind), "#999999")
        for rank, g in grp.groupby("rank"):
            spans = [
                ((s - t0) / scale, (e - s) / scale)
                for s, e in zip(g.start_ns, g.end_ns, strict=True)
            ]
            # compute on the main bar; comm and waits on a thin strip below, so they never hide it
            lane = (rank - 0.4, 0.55) if str(kind) in COMPUTE_KINDS else (rank + 0.2, 0.2)
            ax.broken_barh(spans, lane, facecolors=color, edgecolors="white", linewidth=0.3)
    compute = events[events["kind"].isin(COMPUTE_KINDS)]
    if len(compute) <= 64:  # labels stay legible (and cheap to draw) only for short programs
        for r in compute.itertuples():
            ax.text(
                (r.start_ns + r.end_ns) / 2 / scale - t0 / scale,
                r.rank - 0.125,
                str(r.name),
                ha="center",
                va="center",
                fontsize=5,
                color="white",
                clip_on=True,
            )
    ax.set_yticks(range(n_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(n_ranks)])
    ax.set_ylim(n_ranks - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=9)


def plot_gantt(panels: Sequence[tuple[str, pd.DataFrame]], unit: str = "ms") -> Figure:
    """Per-rank timelines side by side, one panel per (title, events of one step)."""
    panels = [(t, e[e["kind"] != "other"]) for t, e in panels]  # step spans would cover all
    fig, axes = _subplots(
        1,
        len(panels),
        figsize=(
            6.5 * len(panels),
            0.6 + 0.55 * max((int(e["rank"].max()) + 1 if len(e) else 1) for _, e in panels) + 0.8,
        ),
        squeeze=False,
    )
    for ax, (title, ev) in zip(axes[0], panels, strict=True):
        _gantt(ax, ev, title, unit)
    kinds = sorted(
        {str(k) for _, e in panels for k in e["kind"].unique()},
        key=lambda k: list(KIND_COLORS).index(k) if k in KIND_COLORS else 99,
    )
    handles = [Patch(color=KIND_COLORS.get(k, "#999999"), label=k) for k in kinds]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    return fig


def plot_memory_timeline(memory: pd.DataFrame, title: str = "") -> Figure:
    """Memory over time: one panel per run (rows: ``label`` column if present, else run_id),
    one step line per rank, time from the run's first sample."""
    d = memory.copy()
    d["ms"] = (d["t_ns"] - d.groupby("run_id", observed=True)["t_ns"].transform("min")) / 1e6
    d["MiB"] = d["bytes"] / 2**20
    labels = d["label"].astype(str) if "label" in d.columns else d["run_id"].astype(str)
    order = list(dict.fromkeys(labels))
    ncols = min(2, len(order))
    nrows = -(-len(order) // ncols)
    fig, axes = _subplots(
        nrows, ncols, figsize=(5.5 * ncols, 2.4 * nrows), squeeze=False, sharey=True
    )
    palette = sns.color_palette(n_colors=max(2, int(d["rank"].max()) + 1))
    for ax, label in zip(axes.flat, order, strict=False):
        sub = d[labels == label]
        for (rank, what), g in sub.groupby(["rank", "what"], observed=True):
            ax.step(
                g["ms"],
                g["MiB"],
                where="post",
                color=palette[int(rank)],
                label=f"rank {rank}" + (f" {what}" if sub["what"].nunique() > 1 else ""),
            )
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("time in step (ms)", fontsize=8)
        ax.set_ylabel("MiB", fontsize=8)
        ax.legend(fontsize=6, loc="upper right")
    for ax in list(axes.flat)[len(order) :]:
        ax.set_visible(False)
    fig.suptitle(title or "Memory over time", fontsize=9)
    fig.tight_layout()
    return fig
