"""Plots of benchmark results (seaborn, rendered to PNG bytes without pyplot, so the caller's
matplotlib backend is never changed).

Every function takes plain DataFrames (the sweep's runs/steps tables, or event and memory
tables in the :mod:`vpipe.events` schema) and returns a matplotlib Figure, so reports can embed
them and tests can check them without a display.

Figures are made to be read at a glance in the report: at most ``MAX_WIDTH_IN`` wide (shown
unscaled), no text under ``MIN_FONT_PT``, constrained layout (every label inside the figure)
and legends outside the axes, so nothing covers the data.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.textpath import TextToPath
from matplotlib.transforms import Bbox

from vpipe.events import COMPUTE_KINDS
from vpipe.metrics.per_run import pareto_front
from vpipe.schedules import catalogue

BASELINE = catalogue.baseline()
IMPL_ORDER = ("vpipe", "torch")
MAX_WIDTH_IN = 13.5  # 1080 px at to_png's 80 dpi: fits the report's 1200 px column unscaled
MIN_FONT_PT = 8
MIN_PANEL_IN = 4.5
LEGEND_IN = 1.3  # room for a figure legend right of the panels
IMPL_MARKERS = ("o", "s", "^", "D", "v")

# One colour per kind (seaborn "deep"): compute kinds in strong hues; each send and its
# receive in two different hues of one family (purple/pink for F, brown/olive for B).
KIND_COLORS = {
    "F": "#4c72b0",
    "B": "#c44e52",
    "I": "#dd8452",
    "W": "#55a868",
    "SEND_F": "#8172b3",
    "RECV_F": "#da8bc3",
    "SEND_B": "#937860",
    "RECV_B": "#ccb974",
    "WAIT": "#8c8c8c",
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


def _impl_colors(impls: Sequence[str]) -> dict[str, Any]:
    return dict(zip(impls, sns.color_palette(n_colors=max(2, len(impls))), strict=False))


def _subplots(nrows: int, ncols: int, **kw) -> tuple[Figure, Any]:
    """A figure (constrained layout) and its axes without pyplot, so importing or plotting
    never changes the caller's matplotlib backend (a notebook keeps its own)."""
    fig = Figure(figsize=kw.pop("figsize", None), layout="constrained")
    return fig, fig.subplots(nrows, ncols, **kw)


def to_png(fig: Figure, dpi: int = 80) -> bytes:
    """Render a figure to PNG bytes and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _facets(n: int, width: float, height: float) -> tuple[Figure, list]:
    """``n`` panels of about ``width`` x ``height`` inches (at least ``MIN_PANEL_IN`` wide, so
    titles fit), as many per row as fit the report's width beside a figure legend."""
    room = MAX_WIDTH_IN - LEGEND_IN
    width = min(max(width, MIN_PANEL_IN), room)
    ncols = max(1, min(n, int(room // width)))
    nrows = -(-n // ncols)
    size = (width * ncols + LEGEND_IN, height * nrows + 0.7)
    fig, axes = _subplots(nrows, ncols, figsize=size)
    axes = list(np.ravel(axes))
    for ax in axes[n:]:
        fig.delaxes(ax)
    return fig, axes[:n]


def _legend_beside(fig: Figure, handles: list, **kw) -> None:
    """One legend for the whole figure, right of the panels (never over the data)."""
    fig.legend(handles=handles, loc="outside right center", frameon=False, **kw)


def _bytes_unit(n: float) -> tuple[str, int]:
    """The unit that shows ``n`` bytes with a few integer digits: KiB, MiB or GiB."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= div:
            return unit, div
    return "KiB", 2**10


# ---------------------------------------------------------------------------------------------
# Bars per schedule


def _dodged_bars(ax, stats: pd.DataFrame, order: list[str], impls: list[str]) -> pd.DataFrame:
    """Bars of ``stats["height"]`` (one row per impl and schedule), schedules along x and the
    impls side by side within each; returns ``stats`` with each bar's centre ``x``. A missing
    (impl, schedule) leaves a gap."""
    width = 0.8 / len(impls)
    slot = {s: i for i, s in enumerate(order)}
    shift = {impl: (j - (len(impls) - 1) / 2) * width for j, impl in enumerate(impls)}
    pairs = zip(stats["impl"], stats["schedule"], strict=True)
    stats = stats.assign(x=[slot[s] + shift[i] for i, s in pairs])
    for impl, color in _impl_colors(impls).items():
        d = stats[stats["impl"] == impl]
        ax.bar(d["x"], d["height"], width, color=color, label=impl)
    ax.set_xticks(range(len(order)), order, rotation=30, ha="right", rotation_mode="anchor")
    ax.set_xlim(-0.5, len(order) - 0.5)
    return stats


def _bars_width(n_bars: int) -> float:
    """A bar panel's width in inches: half an inch per bar (room for a horizontal ratio label
    over each) and the y axis's labels."""
    return 0.9 + 0.5 * n_bars


def _throughput_stats(d: pd.DataFrame) -> pd.DataFrame:
    """Per impl and schedule: median samples/s (``height``), its 25th/75th percentiles
    (``lo``, ``hi``) and its ratio to the baseline schedule of the same impl."""
    q = d.groupby(["impl", "schedule"], observed=True)["samples_per_s"].quantile([0.25, 0.5, 0.75])
    st = q.unstack().set_axis(["lo", "height", "hi"], axis=1).reset_index()
    base = st[st["schedule"] == BASELINE].set_index("impl")["height"]
    return st.assign(ratio=st["height"] / st["impl"].map(base))


def _ratio_labels(ax, stats: pd.DataFrame, rotation: int) -> None:
    """Each bar's ratio to the baseline, just above the top of its error bar."""
    for r in stats.dropna(subset=["ratio"]).itertuples():
        ax.annotate(
            f"{r.ratio:.2f}x",
            (r.x, r.hi),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            rotation=rotation,
            fontsize=MIN_FONT_PT,
        )


def plot_throughput(steps: pd.DataFrame) -> Figure:
    """Samples/s per schedule and implementation, one panel per microbatch count.

    Bars are medians over measured steps; error bars span the 25th-75th percentile. Each bar is
    labelled, above its error bar, with its ratio to the interleaved-1f1b bar of the same
    implementation. Panels widen with the bar count, so horizontal labels fit over their bars
    (turned upright only when even a full-width panel is too narrow).
    """
    mbs = sorted(steps["microbatches"].unique())
    order = schedule_order(steps["schedule"].unique())
    impls = _impl_order(steps["impl"].unique())
    n_bars = len(order) * len(impls)
    fig, axes = _facets(len(mbs), _bars_width(n_bars), 3.4)
    # labels turn upright only when even a full-width panel leaves too little room per bar
    upright = _bars_width(n_bars) > MAX_WIDTH_IN - LEGEND_IN
    for ax, m in zip(axes, mbs, strict=True):
        st = _dodged_bars(ax, _throughput_stats(steps[steps["microbatches"] == m]), order, impls)
        low, high = st["height"] - st["lo"], st["hi"] - st["height"]
        ax.errorbar(
            st["x"],
            st["height"],
            yerr=[low, high],
            fmt="none",
            ecolor="#333333",
            elinewidth=1.2,
            capsize=3,
        )
        _ratio_labels(ax, st, rotation=90 if upright else 0)
        ax.set_ylim(0, st["hi"].max() * (1.35 if upright else 1.15))
        has_base = st["ratio"].notna().any()
        ax.set_title(f"M={m}" + (f" (labels: ratio to {BASELINE})" if has_base else ""))
        ax.set_ylabel("samples/s (median, IQR)")
    handles = [Patch(color=c, label=i) for i, c in _impl_colors(impls).items()]
    _legend_beside(fig, handles, title="impl")
    fig.suptitle("Throughput (higher is better)")
    return fig


def plot_memory(ranks: pd.DataFrame, column: str = "peak_bytes") -> Figure:
    """Peak memory per schedule: bars are the maximum over ranks, dots each rank's peak."""
    mbs = sorted(ranks["microbatches"].unique())
    order = schedule_order(ranks["schedule"].unique())
    impls = _impl_order(ranks["impl"].unique())
    unit, div = _bytes_unit(float(ranks[column].max()))
    d_all = ranks.assign(value=ranks[column].astype(float) / div)
    fig, axes = _facets(len(mbs), _bars_width(len(order) * len(impls)), 3.4)
    for ax, m in zip(axes, mbs, strict=True):
        d = d_all[d_all["microbatches"] == m]
        peak = d.groupby(["impl", "schedule"], observed=True)["value"].max().rename("height")
        st = _dodged_bars(ax, peak.reset_index(), order, impls)
        dots = d.merge(st[["impl", "schedule", "x"]], on=["impl", "schedule"])
        ax.scatter(dots["x"], dots["value"], s=12, color="black", zorder=3)
        ax.set_title(f"M={m}")
        ax.set_ylabel(f"peak {unit} (max over ranks)")
    handles = [Patch(color=c, label=i) for i, c in _impl_colors(impls).items()]
    handles.append(Line2D([], [], ls="", marker="o", ms=4, color="black", label="one rank"))
    _legend_beside(fig, handles)
    fig.suptitle("Peak activation memory (lower is better)")
    return fig


# ---------------------------------------------------------------------------------------------
# Throughput against memory


def plot_pareto(
    runs: pd.DataFrame, x: str = "peak_memory_bytes", y: str = "samples_per_s"
) -> Figure:
    """Throughput against peak memory, one panel per microbatch count, one point per
    (schedule, impl): labelled with the schedule, coloured and shaped by impl.

    The Pareto front (:func:`vpipe.metrics.per_run.pareto_front`: the configs no other config beats
    on both) is drawn as a step line, the best throughput within each memory budget, with its
    points ringed in black; the dominated points are faded.
    """
    d = runs.dropna(subset=[x, y])
    if d.empty:
        fig, ax = _subplots(1, 1, figsize=(6.0, 1.2))
        ax.set_axis_off()
        ax.text(0.5, 0.5, f"no run has both {x} and {y}", ha="center", transform=ax.transAxes)
        return fig
    unit, div = _bytes_unit(float(d[x].max()))
    d = d.assign(plot_x=d[x].astype(float) / div, plot_y=d[y].astype(float))
    mbs = sorted(d["microbatches"].unique())
    impls = _impl_order(d["impl"].unique())
    style = _point_styles(impls)
    fig, axes = _facets(len(mbs), 5.5, 4.4)
    panels = []
    for ax, m in zip(axes, mbs, strict=True):
        panels.append(_pareto_panel(ax, d[d["microbatches"] == m], style))
        ax.set_title(f"M={m}")
        ax.set_xlabel(f"peak memory ({unit}, max over ranks)")
        ax.set_ylabel("samples/s (median)")
    _legend_beside(fig, _pareto_handles(style))
    fig.suptitle("Throughput vs peak memory (up and to the left is better)")
    fig.draw_without_rendering()  # fixes the layout and limits: the labels go where they fit
    for ax, pts in zip(axes, panels, strict=True):
        _place_labels(ax, pts)
    return fig


def _point_styles(impls: list[str]) -> dict[str, tuple[Any, str, float]]:
    """Colour, marker and relative size per impl; later impls smaller, so configs tied on
    both axes show every marker (one inside the other)."""
    return {
        impl: (color, IMPL_MARKERS[j % len(IMPL_MARKERS)], 0.4**j)
        for j, (impl, color) in enumerate(_impl_colors(impls).items())
    }


def _pareto_handles(style: dict[str, tuple[Any, str, float]]) -> list[Line2D]:
    """Legend entries: each impl's marker, the front's line and ring, a faded point."""
    handles = [
        Line2D([], [], ls="", marker=mk, ms=8, color=c, label=i) for i, (c, mk, _) in style.items()
    ]
    ring = dict(marker="o", mfc="white", mec="black", mew=1.5)
    handles.append(Line2D([], [], color="black", label="Pareto front (ringed)", **ring))
    handles.append(Line2D([], [], ls="", marker="o", color="grey", alpha=0.45, label="dominated"))
    return handles


def _pareto_panel(ax, d: pd.DataFrame, style: dict[str, tuple[Any, str, float]]) -> pd.DataFrame:
    """The points (``plot_x``, ``plot_y``) of one panel and their front; returns the points, front
    first, with a ``front`` flag, for labelling once the layout is fixed."""
    front = pareto_front(d, "plot_x", "plot_y")
    ax.step(
        front["plot_x"],
        front["plot_y"],
        where="post",
        color="black",
        lw=1.2,
        zorder=2,
        gid="pareto-front-line",
    )
    d = d.assign(front=d.index.isin(front.index))
    for (impl, on), g in d.groupby(["impl", "front"], observed=True):
        color, marker, area = style[impl]
        ax.scatter(
            g["plot_x"],
            g["plot_y"],
            marker=marker,
            color=color,
            s=(90 if on else 45) * area,
            edgecolors="black" if on else "none",
            linewidths=1.5 * area**0.5,
            alpha=1 if on else 0.45,
            zorder=4 - area,  # smaller markers on top
            gid="pareto-front-points" if on else None,
        )
    ax.margins(0.15)  # room for the labels inside the axes
    return d.sort_values("front", ascending=False, kind="stable")


# Label spots around a point (offset in points, alignment): beside, above/below, diagonal,
# then the same farther out.
_SPOTS = [
    (7, 0, "left", "center"),
    (-7, 0, "right", "center"),
    (0, 7, "center", "bottom"),
    (0, -7, "center", "top"),
    (6, 6, "left", "bottom"),
    (-6, 6, "right", "bottom"),
    (6, -6, "left", "top"),
    (-6, -6, "right", "top"),
]
_LABEL_SPOTS = [(dx * k, dy * k, ha, va) for k in (1.0, 2.2, 3.4) for dx, dy, ha, va in _SPOTS]


def _place_labels(ax, pts: pd.DataFrame) -> None:
    """Label each point with its schedule at the first spot in ``_LABEL_SPOTS`` that stays in
    the axes and clears every point and the labels placed before (front points first); the
    least crowded spot when none is clear. Needs the figure laid out."""
    xy = ax.transData.transform(pts[["plot_x", "plot_y"]].to_numpy(dtype=float))
    r = 5.5 * ax.figure.dpi / 72  # the largest marker's radius in pixels
    taken = [Bbox.from_extents(px - r, py - r, px + r, py + r) for px, py in xy]
    taken += _staircase_boxes(ax, pts[pts["front"]])
    for p in pts.itertuples():
        ann = ax.annotate(
            str(p.schedule),
            (p.plot_x, p.plot_y),
            xytext=(0, 0),
            textcoords="offset points",
            fontsize=MIN_FONT_PT + 1,
            fontweight="bold" if p.front else "normal",
        )
        clashes = []
        for spot in _LABEL_SPOTS:
            clashes.append(_clashes(ann, spot, ax, taken))
            if clashes[-1] == 0:
                break
        _clashes(ann, _LABEL_SPOTS[int(np.argmin(clashes))], ax, taken)
        taken.append(ann.get_window_extent())


def _staircase_boxes(ax, front: pd.DataFrame) -> list[Bbox]:
    """Display boxes of the front's step line: one per horizontal and vertical piece."""
    xy = front.sort_values("plot_x")[["plot_x", "plot_y"]].to_numpy(dtype=float)
    xy = ax.transData.transform(xy)
    boxes = []
    for (x0, y0), (x1, y1) in zip(xy[:-1], xy[1:], strict=True):
        boxes.append(Bbox.from_extents(x0, y0, x1, y0).padded(1))
        boxes.append(Bbox.from_extents(x1, min(y0, y1), x1, max(y0, y1)).padded(1))
    return boxes


def _clashes(ann, spot: tuple[float, float, str, str], ax, taken: list[Bbox]) -> int:
    """Move ``ann`` to ``spot``; how many boxes it then overlaps (100 if it leaves the axes)."""
    dx, dy, ha, va = spot
    ann.xyann = (dx, dy)
    ann.set_horizontalalignment(ha)
    ann.set_verticalalignment(va)
    box = ann.get_window_extent()
    inside = ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1)
    return (0 if inside else 100) + sum(box.overlaps(b) for b in taken)


# ---------------------------------------------------------------------------------------------
# Timelines


def _spans(events: pd.DataFrame, unit: str) -> pd.DataFrame:
    """Events with ``x0``/``x1``: start and end in ``unit`` from the panel's first event."""
    scale = {"ms": 1e6, "us": 1e3}[unit]
    t0 = events["start_ns"].min() if len(events) else 0
    return events.assign(x0=(events["start_ns"] - t0) / scale, x1=(events["end_ns"] - t0) / scale)


def _gantt(ax, events: pd.DataFrame, title: str) -> None:
    """One panel: a lane per rank, compute spans as the main bar, sends, receives and waits
    on a thin strip below it (so they never hide compute)."""
    n_ranks = int(events["rank"].max()) + 1 if len(events) else 1
    for (kind, rank), g in events.groupby(["kind", "rank"], observed=True):
        lane = (rank - 0.4, 0.55) if str(kind) in COMPUTE_KINDS else (rank + 0.2, 0.2)
        ax.broken_barh(
            list(zip(g["x0"], g["x1"] - g["x0"], strict=True)),
            lane,
            facecolors=KIND_COLORS.get(str(kind), "#999999"),
            edgecolors="white",
            linewidth=0.3,
        )
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.set_ylim(n_ranks - 0.5, -0.5)
    ax.set_title(title, loc="left", fontsize=10)


def _text_width_pt(s: str, size: float) -> float:
    return TextToPath().get_text_width_height_descent(s, FontProperties(size=size), False)[0]


def _name_labels(ax, events: pd.DataFrame) -> None:
    """Each compute bar's action name inside it, where the name fits the bar's width on the
    page (so needs the figure laid out)."""
    compute = events[events["kind"].isin(COMPUTE_KINDS)]
    y = np.zeros(len(compute))
    left = ax.transData.transform(np.c_[compute["x0"], y])[:, 0]
    right = ax.transData.transform(np.c_[compute["x1"], y])[:, 0]
    room_pt = (right - left) * 72 / ax.figure.dpi
    for r, room in zip(compute.itertuples(), room_pt, strict=True):
        if _text_width_pt(str(r.name), MIN_FONT_PT) + 2 <= room:
            ax.text(
                (r.x0 + r.x1) / 2,
                r.rank - 0.125,
                str(r.name),
                ha="center",
                va="center",
                fontsize=MIN_FONT_PT,
                color="white",
                clip_on=True,
            )


def plot_gantt(panels: Sequence[tuple[str, pd.DataFrame]], unit: str = "ms") -> Figure:
    """Per-rank timelines stacked on one shared time axis (same scale), one panel per
    (title, events of one step), so measured and simulated steps compare at a glance.

    Every event kind has its own colour; compute bars carry their action's name where it
    fits."""
    panels = [(t, _spans(e[e["kind"] != "other"], unit)) for t, e in panels]  # no step spans
    n_ranks = max((int(e["rank"].max()) + 1 if len(e) else 1) for _, e in panels)
    height = len(panels) * (0.55 + 0.4 * n_ranks) + 0.9
    fig, axes = _subplots(
        len(panels), 1, figsize=(MAX_WIDTH_IN, height), sharex=True, squeeze=False
    )
    axes = list(axes[:, 0])
    for ax, (title, ev) in zip(axes, panels, strict=True):
        _gantt(ax, ev, title)
    end = max((e["x1"].max() for _, e in panels if len(e)), default=1.0)
    axes[0].set_xlim(0, end * 1.01)
    axes[-1].set_xlabel(f"time from the step's first event ({unit})")
    present = {str(k) for _, e in panels for k in e["kind"].unique()}
    kinds = [k for k in KIND_COLORS if k in present] + sorted(present - set(KIND_COLORS))
    _legend_beside(fig, [Patch(color=KIND_COLORS.get(k, "#999999"), label=k) for k in kinds])
    fig.draw_without_rendering()  # fixes the layout: the name labels need the bars' widths
    for ax, (_, ev) in zip(axes, panels, strict=True):
        _name_labels(ax, ev)
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
    return fig
