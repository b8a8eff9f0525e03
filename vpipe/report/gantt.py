"""Timelines of one step: per-rank Gantt charts and the bytes saved for backward over a step.

Each Gantt panel (measured vpipe, measured torch, simulated) has its own time axis, from its
step's first event to its last, so a fast step is not a row of slivers beside a slow one; the
panel's title gives the step's length. Bars are coloured by kind and carry the action's name
where it fits (else its kind and microbatch, else its kind). An overlap action
(``(0F3;3B1)OVERLAP_F_B``, one span while both parts run) is drawn as its two parts: the upper
half in the first part's colour, the lower half in the second's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Patch
from matplotlib.textpath import TextToPath

from vpipe.events import COMPUTE_KINDS
from vpipe.report.plots import KIND_COLORS, MAX_WIDTH_IN, MIN_FONT_PT, _legend_beside, _subplots

_PART = re.compile(r"(\d+)([FBIW])(\d+)")
_COMPUTE_LANE = (-0.4, 0.55)  # offset from the rank's row, height
_COMM_LANE = (0.2, 0.2)  # a thin strip below the compute bars: sends, receives, waits


def overlap_parts(name: str) -> list[tuple[str, int]]:
    """``[("F", 3), ("B", 1)]`` for ``(0F3;3B1)OVERLAP_F_B``; [] for a plain action."""
    if ";" not in name:
        return []
    return [(kind, int(mb)) for _, kind, mb in _PART.findall(name.split(")", 1)[0])]


def _spans(events: pd.DataFrame, unit: str) -> pd.DataFrame:
    """Events with ``x0``/``x1``: start and end in ``unit`` from the panel's first event."""
    scale = {"ms": 1e6, "us": 1e3}[unit]
    t0 = events["start_ns"].min() if len(events) else 0
    return events.assign(x0=(events["start_ns"] - t0) / scale, x1=(events["end_ns"] - t0) / scale)


def _bars(ax, spans: list[tuple[float, float]], y: float, h: float, color: str, gid: str) -> None:
    ax.broken_barh(spans, (y, h), facecolors=color, edgecolors="white", linewidth=0.3, gid=gid)


def _gantt(ax, events: pd.DataFrame, n_ranks: int) -> None:
    """One panel: a lane per rank, compute bars on top, communication and waits below."""
    names = events["name"].astype(str)
    parts = names.map(overlap_parts)
    is_overlap = parts.map(len) == 2
    for (kind, rank), g in events[~is_overlap].groupby(["kind", "rank"], observed=True):
        compute = str(kind) in COMPUTE_KINDS
        off, h = _COMPUTE_LANE if compute else _COMM_LANE
        spans = list(zip(g["x0"], g["x1"] - g["x0"], strict=True))
        _bars(ax, spans, rank + off, h, KIND_COLORS.get(str(kind), "#999999"), f"kind-{kind}")
    off, h = _COMPUTE_LANE
    for r, (first, second) in zip(events[is_overlap].itertuples(), parts[is_overlap], strict=True):
        span = [(r.x0, r.x1 - r.x0)]
        _bars(ax, span, r.rank + off, h / 2, KIND_COLORS[first[0]], "overlap-first")
        _bars(ax, span, r.rank + off + h / 2, h / 2, KIND_COLORS[second[0]], "overlap-second")
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.set_ylim(n_ranks - 0.5, -0.5)


def _text_width_pt(s: str, size: float) -> float:
    return TextToPath().get_text_width_height_descent(s, FontProperties(size=size), False)[0]


def bar_labels(name: str, kind: str) -> list[str]:
    """What a compute bar may show, longest first: ``3F0``, ``F0``, ``F`` (an overlap
    action: ``F3+B1``, ``F+B``)."""
    parts = overlap_parts(name)
    if parts:
        return ["+".join(f"{k}{m}" for k, m in parts), "+".join(k for k, _ in parts)]
    m = _PART.fullmatch(name)
    return [name, f"{m.group(2)}{m.group(3)}", kind] if m else [name, kind]


def _name_labels(ax, events: pd.DataFrame) -> None:
    """Each compute bar's longest label that fits its width on the page (needs the layout)."""
    compute = events[events["kind"].isin(COMPUTE_KINDS)]
    y = np.zeros(len(compute))
    left = ax.transData.transform(np.c_[compute["x0"], y])[:, 0]
    right = ax.transData.transform(np.c_[compute["x1"], y])[:, 0]
    room_pt = (right - left) * 72 / ax.figure.dpi
    for r, room in zip(compute.itertuples(), room_pt, strict=True):
        label = next(
            (t for t in bar_labels(str(r.name), str(r.kind))
             if _text_width_pt(t, MIN_FONT_PT) + 2 <= room),
            None,
        )  # fmt: skip
        if label is not None:
            ax.text((r.x0 + r.x1) / 2, r.rank - 0.125, label, ha="center", va="center",
                    fontsize=MIN_FONT_PT, color="white", clip_on=True)  # fmt: skip


def plot_gantt(panels: Sequence[tuple[str, pd.DataFrame]], unit: str = "ms") -> Figure:
    """Per-rank timelines, one panel per (title, events of one step), each on its own time
    axis from its step's first event to its last (the title gives that length)."""
    panels = [(t, _spans(e[e["kind"] != "other"], unit)) for t, e in panels]  # no step spans
    n_ranks = max((int(e["rank"].max()) + 1 if len(e) else 1) for _, e in panels)
    height = len(panels) * (0.85 + 0.4 * n_ranks) + 0.5
    fig, axes = _subplots(len(panels), 1, figsize=(MAX_WIDTH_IN, height), squeeze=False)
    axes = list(axes[:, 0])
    for ax, (title, ev) in zip(axes, panels, strict=True):
        _gantt(ax, ev, n_ranks)
        end = float(ev["x1"].max()) if len(ev) else 1.0
        ax.set_xlim(0, end * 1.01)
        ax.set_title(f"{title}: step {end:.1f} {unit} (own time axis)", loc="left", fontsize=10)
        ax.set_xlabel(f"{unit} from the step's first event", fontsize=MIN_FONT_PT)
    present = {str(k) for _, e in panels for k in e["kind"].unique()}
    kinds = [k for k in KIND_COLORS if k in present] + sorted(present - set(KIND_COLORS))
    handles = [Patch(color=KIND_COLORS.get(k, "#999999"), label=k) for k in kinds]
    if any(e["name"].astype(str).str.contains(";").any() for _, e in panels):
        handles.append(Patch(facecolor="white", edgecolor="black", label="overlap: two halves"))
    _legend_beside(fig, handles)
    fig.draw_without_rendering()  # fixes the layout: the name labels need the bars' widths
    for ax, (_, ev) in zip(axes, panels, strict=True):
        _name_labels(ax, ev)
    return fig


def plot_memory_timeline(memory: pd.DataFrame, title: str = "") -> Figure:
    """Memory over one step: one panel per run (``label`` column if present, else run_id), one
    step line per rank, time from the step's first sample to its last (the panel's range);
    the title gives that length and, with a ``timed_ms`` column, the run's timed median step
    (the metered step is one more step, run with hooks that count the saved tensors: its length
    is not the step time)."""
    d = memory.copy()
    d["ms"] = (d["t_ns"] - d.groupby("run_id", observed=True)["t_ns"].transform("min")) / 1e6
    d["MiB"] = d["bytes"] / 2**20
    labels = d["label"].astype(str) if "label" in d.columns else d["run_id"].astype(str)
    order = list(dict.fromkeys(labels))
    ncols = min(2, len(order))
    nrows = -(-len(order) // ncols)
    fig, axes = _subplots(
        nrows, ncols, figsize=(5.9 * ncols + 0.9, 2.7 * nrows + 0.4), squeeze=False, sharey=True
    )
    palette = sns.color_palette(n_colors=max(2, int(d["rank"].max()) + 1))
    for ax, label in zip(axes.flat, order, strict=False):
        sub = d[labels == label]
        for (rank, what), g in sub.groupby(["rank", "what"], observed=True):
            ax.step(g["ms"], g["MiB"], where="post", color=palette[int(rank)],
                    label=f"rank {rank}" + (f" {what}" if sub["what"].nunique() > 1 else ""))  # fmt: skip
        end = float(sub["ms"].max())
        ax.set_xlim(0, end * 1.01 if end > 0 else 1.0)
        timed = sub["timed_ms"].iloc[0] if "timed_ms" in sub.columns else None
        extra = f", timed median {timed:.1f} ms" if timed is not None and timed == timed else ""
        ax.set_title(f"{label}: metered step {end:.1f} ms{extra}", fontsize=MIN_FONT_PT + 1)
        ax.set_xlabel("ms from the step's first sample", fontsize=MIN_FONT_PT)
        ax.set_ylabel("MiB saved", fontsize=MIN_FONT_PT)
    for ax in list(axes.flat)[len(order) :]:
        ax.set_visible(False)
    handles, seen = [], set()
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in seen:
                seen.add(lab)
                handles.append(h)
    _legend_beside(fig, handles)  # one legend, outside the panels: it never hides a line
    fig.suptitle(title or "Memory over time", fontsize=MIN_FONT_PT + 2)
    return fig
