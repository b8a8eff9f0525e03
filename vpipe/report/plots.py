"""Plots of benchmark results (seaborn, rendered to PNG bytes without pyplot, so the caller's
matplotlib backend is never changed).

Every function takes plain DataFrames (the sweep's runs/steps tables) and returns a matplotlib
Figure, so reports can embed them and tests can check them without a display; the timelines of
one step (Gantt charts, memory over a step) are in :mod:`vpipe.report.gantt`.

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
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import Bbox

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
    "GPU": "#64b5cd",  # other GPU work (another thread's, a side stream's)
    "other": "#dddddd",
}


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
    order = catalogue.display_order(steps["schedule"].unique())
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
    order = catalogue.display_order(ranks["schedule"].unique())
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
    runs: pd.DataFrame,
    x: str = "peak_memory_bytes",
    y: str = "samples_per_s",
    *,
    predicted: bool = False,
) -> Figure:
    """Throughput against peak memory, one panel per microbatch count, one point per
    (schedule, impl): labelled with the schedule, coloured and shaped by impl.

    Each impl has its own Pareto front (:func:`vpipe.metrics.per_run.pareto_front`: its configs
    no other config of that impl beats on both), drawn as a step line in the impl's colour (the
    best throughput within each memory budget) with its points filled and ringed; dominated
    points are drawn hollow, fully visible. ``predicted``: the figures are simulated (``vpipe
    plan``), and the axes and title say so; a panel of every M is titled so.
    """
    d = runs.dropna(subset=[x, y])
    if d.empty:
        fig, ax = _subplots(1, 1, figsize=(6.0, 1.2))
        ax.set_axis_off()
        ax.text(0.5, 0.5, f"no run has both {x} and {y}", ha="center", transform=ax.transAxes)
        return fig
    unit, div = ("units", 1) if x.endswith("_units") else _bytes_unit(float(d[x].max()))
    d = d.assign(plot_x=d[x].astype(float) / div, plot_y=d[y].astype(float))
    mbs = sorted(d["microbatches"].unique(), key=str)
    impls = _impl_order(d["impl"].unique())
    style = _point_styles(impls)
    fig, axes = _facets(len(mbs), 5.5, 4.4)
    panels = []
    for ax, m in zip(axes, mbs, strict=True):
        panels.append(_pareto_panel(ax, d[d["microbatches"] == m], style))
        ax.set_title("the candidates on the front (label: family vV MM)" if m == "all"
                     else f"M={m}")  # fmt: skip
        ax.set_xlabel(f"peak {'activation ' if predicted else ''}memory ({unit}, max over ranks)")
        ax.set_ylabel("predicted samples/s (simulated)" if predicted else "samples/s (median)")
    dominated = any(not p["front"].all() for p in panels)
    _legend_beside(fig, _pareto_handles(style, dominated))
    fig.suptitle(
        "Predicted throughput vs peak memory (vpipe plan: simulated, not measured)"
        if predicted
        else "Throughput vs peak memory (up and to the left is better)"
    )
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


def _pareto_handles(style: dict[str, tuple[Any, str, float]], dominated: bool) -> list[Line2D]:
    """Legend entries: each impl's front (its marker on its colour's line), and a hollow
    marker for dominated points when the figure has any."""
    ring = dict(mec="black", mew=1.2, ms=8)
    handles = [
        Line2D([], [], color=c, marker=mk, label=f"{i}: Pareto front", **ring)
        for i, (c, mk, _) in style.items()
    ]
    if dominated:
        handles.append(Line2D([], [], ls="", marker="o", mfc="white", mec="#555555", mew=1.5,
                              ms=7, label="dominated (hollow)"))  # fmt: skip
    return handles


def _pareto_panel(ax, d: pd.DataFrame, style: dict[str, tuple[Any, str, float]]) -> pd.DataFrame:
    """The points (``plot_x``, ``plot_y``) of one panel and each impl's front; returns the
    points, fronts first, with a ``front`` flag, for labelling once the layout is fixed."""
    on_front = pd.Series(False, index=d.index)
    for impl, g in d.groupby("impl", observed=True, sort=False):
        color, marker, area = style[impl]
        front = pareto_front(g, "plot_x", "plot_y")
        on_front[front.index] = True
        ax.step(front["plot_x"], front["plot_y"], where="post", color=color, lw=1.5, zorder=2,
                gid=f"pareto-front-line-{impl}")  # fmt: skip
    d = d.assign(front=on_front)
    for (impl, on), g in d.groupby(["impl", "front"], observed=True):
        color, marker, area = style[impl]
        ax.scatter(
            g["plot_x"],
            g["plot_y"],
            marker=marker,
            facecolors=color if on else "white",
            edgecolors="black" if on else color,
            s=(90 if on else 60) * area,
            linewidths=(1.5 if on else 2.0) * area**0.5,
            zorder=4 - area,  # smaller markers on top
            gid=f"pareto-front-points-{impl}" if on else f"dominated-{impl}",
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
    for _, front in pts[pts["front"]].groupby("impl", observed=True):  # each impl's front
        taken += _staircase_boxes(ax, front)
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
