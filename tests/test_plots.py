"""Plots a reader can read at a glance, judged on the rendered figure: no two labels overlap,
everything lies inside the figure, legends sit outside the axes, fonts are legible at the
report's width, each Gantt panel has its own time axis and every event kind its own colour, an
overlap action shows its two parts, memory panels span their own step, each impl has its own
Pareto front with dominated points visible, and plan plots say they show predictions."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from vpipe.events import COMM_KINDS, COMPUTE_KINDS, events_frame
from vpipe.metrics.per_run import pareto_front
from vpipe.predict.plan import pareto_frame
from vpipe.report.gantt import plot_gantt, plot_memory_timeline
from vpipe.report.plots import KIND_COLORS, plot_memory, plot_pareto, plot_throughput
from vpipe.schedules import catalogue

SCHEDULES = catalogue.names()  # every catalogued schedule: many narrow bars
VPIPE_ONLY = "looped-bfs"  # no torch bar: a gap in its group
REPORT_WIDTH_PX = 1100  # the report's column (max-width 1200px less padding); to_png uses 80 dpi
MIN_FONT_PT = 8


def _steps() -> pd.DataFrame:
    """Close throughputs with wide spreads: the worst case for labels near error bars."""
    rng = np.random.default_rng(3)
    rows = []
    for m, (s, sched), impl, k in itertools.product(
        (4, 8), enumerate(SCHEDULES), ("vpipe", "torch"), range(9)
    ):
        if (sched, impl) == (VPIPE_ONLY, "torch"):
            continue
        t = 0.04 * (1 + 0.03 * s) * (1.1 if impl == "torch" else 1.0) * (1 + 0.3 * rng.random())
        rows.append(
            dict(schedule=sched, microbatches=m, impl=impl, round=k // 3, step=k % 3,
                 step_time_s=t, samples_per_s=32 / t)
        )  # fmt: skip
    return pd.DataFrame(rows)


def _ranks() -> pd.DataFrame:
    return pd.DataFrame(
        [
            dict(schedule=sched, microbatches=m, impl=impl, rank=r,
                 peak_bytes=int((300 + 40 * s + 90 * r) * 2**20 * 4 / m))
            for m in (4, 8)
            for s, sched in enumerate(SCHEDULES)
            for impl in ("vpipe", "torch")
            for r in range(2)
        ]
    )  # fmt: skip


def _runs() -> pd.DataFrame:
    """Configs of two microbatch counts whose front is a staircase, with ties: torch has
    vpipe's memory everywhere, and zbv's two impls tie on both axes."""
    vpipe = {"gpipe": (600, 500), "1f1b": (400, 520), "interleaved-1f1b": (420, 560),
             "looped-bfs": (450, 540), "zb-h1": (400, 620), "zbv": (300, 600),
             "dualpipev": (500, 650)}  # fmt: skip
    rows = []
    for m, sched, impl in itertools.product((4, 8), list(vpipe), ("vpipe", "torch")):
        mem, thru = vpipe[sched]
        if impl == "torch" and sched != "zbv":
            thru *= 0.9
            mem = 250 if sched == "gpipe" else mem
        if (sched, impl) != (VPIPE_ONLY, "torch"):
            rows.append(dict(schedule=sched, microbatches=m, impl=impl, samples_per_s=thru * m / 4,
                             peak_memory_bytes=mem * 2**20 * 4 // m))  # fmt: skip
    return pd.DataFrame(rows).astype({"peak_memory_bytes": "Int64", "samples_per_s": "Float64"})


def _events(span_ns: int) -> pd.DataFrame:
    """Two ranks running every event kind; the step lasts about ``span_ns``."""
    kinds = [*COMPUTE_KINDS, *COMM_KINDS, "WAIT"]
    rows, n = [], 24
    for rank in range(2):
        for i in range(n):
            kind = kinds[i % len(kinds)]
            start = i * span_ns // n
            rows.append(
                dict(run_id="r", source="measured", impl="vpipe", schedule="zbv", rank=rank,
                     step=0, stage=rank, microbatch=i // len(kinds), kind=kind,
                     name=f"{rank}{kind}{i}", start_ns=start, end_ns=start + span_ns // n - 10)
            )  # fmt: skip
    return events_frame(rows)


def _gantt() -> Figure:
    return plot_gantt(
        [
            ("zbv vpipe measured", _events(100_000_000)),
            ("zbv torch measured", _events(120_000_000)),
            ("zbv simulated", _events(90_000_000)),
        ]
    )


def _memory_timeline() -> Figure:
    rows = [
        dict(run_id=f"r{j}", rank=r, t_ns=int(k * span * 1e6 / 10), bytes=(k % 5) * 2**20,
             what="saved_activations", label=f"zbv {impl}", timed_ms=span * 0.8)
        for j, (impl, span) in enumerate((("vpipe", 20.0), ("torch", 40.0)))
        for r in range(2)
        for k in range(11)
    ]  # fmt: skip
    return plot_memory_timeline(pd.DataFrame(rows), "Bytes saved for backward")


def _render(fig: Figure):
    """Lay out and draw the figure as to_png would; returns the renderer."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _legends(fig: Figure) -> list:
    return [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]


def _labels(fig: Figure) -> list[Text]:
    """Every title, axis label, annotation and legend text (tick labels aside)."""
    texts = [fig._suptitle] if fig._suptitle is not None else []
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
    for leg in _legends(fig):
        texts += [leg.get_title(), *leg.get_texts()]
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def _overlapping(boxes: list[tuple[str, Bbox]]) -> list[tuple[str, str]]:
    return [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]


def _whiskers(ax) -> list[Bbox]:
    """Display boxes of the error bars, padded by 2 px: each line or line-collection segment
    (NaN separates the pieces of one line), and each marker of a marker-only line (caps)."""
    boxes = []
    for ln in ax.lines:
        xy = ax.transData.transform(ln.get_xydata())
        if ln.get_linestyle() == "None":
            r = ln.get_markersize() / 2 * ax.figure.dpi / 72
            boxes += [Bbox.from_extents(x - r, y, x + r, y).padded(2) for x, y in xy]
        else:
            boxes.append(Bbox([np.nanmin(xy, axis=0), np.nanmax(xy, axis=0)]).padded(2))
    for c in ax.collections:
        if isinstance(c, LineCollection):
            for seg in c.get_segments():
                xy = ax.transData.transform(seg)
                boxes.append(Bbox([xy.min(axis=0), xy.max(axis=0)]).padded(2))
    return boxes


def _few(df: pd.DataFrame) -> pd.DataFrame:
    """A quick sweep's share: two schedules, one microbatch count (narrow panels)."""
    return df[df["schedule"].isin(["interleaved-1f1b", "zbv"]) & (df["microbatches"] == 4)]


FIGURES = {
    "throughput": lambda: plot_throughput(_steps()),
    "throughput-few": lambda: plot_throughput(_few(_steps())),
    "memory": lambda: plot_memory(_ranks()),
    "memory-few": lambda: plot_memory(_few(_ranks())),
    "gantt": _gantt,
    "gantt-one": lambda: plot_gantt([("zbv simulated", _events(90_000_000))]),
    "memory-timeline": _memory_timeline,
    "pareto": lambda: plot_pareto(_runs()),
    "pareto-few": lambda: plot_pareto(_few(_runs())),
}


@pytest.mark.parametrize("name", FIGURES)
def test_everything_lies_inside_the_figure(name):
    fig = FIGURES[name]()
    renderer = _render(fig)
    tight = fig.get_tightbbox(renderer)  # inches, every artist drawn
    w, h = fig.get_size_inches()
    eps = 0.02
    assert tight.x0 >= -eps and tight.y0 >= -eps, (name, tight)
    assert tight.x1 <= w + eps and tight.y1 <= h + eps, (name, tight, (w, h))


@pytest.mark.parametrize("name", FIGURES)
def test_no_two_labels_overlap(name):
    fig = FIGURES[name]()
    renderer = _render(fig)
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _labels(fig)]
    assert not _overlapping(boxes)


@pytest.mark.parametrize("name", FIGURES)
def test_legends_lie_outside_every_axes(name):
    fig = FIGURES[name]()
    renderer = _render(fig)
    legends = _legends(fig)
    assert legends, "no legend"
    for leg, ax in itertools.product(legends, fig.axes):
        assert not leg.get_window_extent(renderer).overlaps(ax.bbox), (name, ax.get_title())


@pytest.mark.parametrize("name", FIGURES)
def test_fonts_are_legible_at_the_report_width(name):
    fig = FIGURES[name]()
    assert fig.get_size_inches()[0] * 80 <= REPORT_WIDTH_PX  # shown unscaled in the report
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    small = {t.get_text(): t.get_fontsize() for t in texts if t.get_fontsize() < MIN_FONT_PT}
    assert not small


def test_throughput_ratio_labels_clear_the_error_bars():
    fig = plot_throughput(_steps())
    renderer = _render(fig)
    for ax in fig.axes:
        labels = [t for t in ax.texts if t.get_text().endswith("x")]
        assert len(labels) == 2 * len(SCHEDULES) - 1
        bars = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_height() > 0]
        for t in labels:
            box = t.get_window_extent(renderer)
            assert ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1)
            assert not any(box.overlaps(w) for w in _whiskers(ax)), t.get_text()
            assert not any(box.overlaps(b.get_window_extent(renderer)) for b in bars)


def test_gantt_panels_each_have_their_own_time_axis():
    fig = _gantt()
    _render(fig)
    assert len(fig.axes) == 3
    for ax, span_ms in zip(fig.axes, (100, 120, 90), strict=True):
        end = span_ms * 23 / 24 + span_ms / 24 - 1e-5  # the last event's end
        assert ax.get_xlim() == pytest.approx((0, end * 1.01))
        assert f"step {end:.1f} ms" in ax.get_title(loc="left")
        assert ax.get_xlabel() == "ms from the step's first event"
        assert len([t for t in ax.texts if t.get_text()]) >= 8  # most compute bars labelled


def test_gantt_draws_an_overlap_action_as_its_two_parts():
    ev = _events(100_000_000)
    first = ev.index[ev["kind"] == "F"][0]
    ev["name"] = ev["name"].cat.add_categories(["(0F3;3B1)OVERLAP_F_B"])
    ev.loc[first, "name"] = "(0F3;3B1)OVERLAP_F_B"
    fig = plot_gantt([("dualpipev measured", ev)])
    _render(fig)
    (ax,) = fig.axes
    halves = {c.get_gid(): c for c in ax.collections if c.get_gid().startswith("overlap")}
    assert to_rgb(halves["overlap-first"].get_facecolor()[0]) == to_rgb(KIND_COLORS["F"])
    assert to_rgb(halves["overlap-second"].get_facecolor()[0]) == to_rgb(KIND_COLORS["B"])
    assert {t.get_text() for t in ax.texts} & {"F3+B1", "F+B"}
    assert "overlap: two halves" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_memory_timeline_panels_span_their_own_step():
    fig = _memory_timeline()
    _render(fig)
    for ax, end in zip(fig.axes, (20.0, 40.0), strict=True):
        assert ax.get_xlim() == pytest.approx((0, end * 1.01))
        assert f"metered step {end:.1f} ms, timed median" in ax.get_title()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["rank 0", "rank 1"]


def test_gantt_gives_every_event_kind_its_own_colour():
    fig = _gantt()
    (legend,) = fig.legends
    colours = {
        t.get_text(): (to_rgb(h.get_facecolor()), h.get_hatch())
        for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)
    }
    assert set(colours) == {*COMPUTE_KINDS, *COMM_KINDS, "WAIT"}
    for (a, (ca, ha)), (b, (cb, hb)) in itertools.combinations(colours.items(), 2):
        if ha == hb:
            assert np.linalg.norm(np.subtract(ca, cb)) > 0.15, (a, b)


def test_pareto_plot_draws_each_impls_front_and_labels_every_point():
    runs = _runs()
    fig = plot_pareto(runs)
    renderer = _render(fig)
    assert [ax.get_title() for ax in fig.axes] == ["M=4", "M=8"]
    legend_texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend_texts == ["vpipe: Pareto front", "torch: Pareto front", "dominated (hollow)"]
    for ax, m in zip(fig.axes, (4, 8), strict=True):
        d = runs[runs["microbatches"] == m]
        assert "MiB" in ax.get_xlabel() and ax.get_ylabel() == "samples/s (median)"
        for impl in ("vpipe", "torch"):
            mine = d[d["impl"] == impl]
            front = pareto_front(mine, "peak_memory_bytes", "samples_per_s")
            if m == 4 and impl == "vpipe":
                assert set(front["schedule"]) == {"zbv", "zb-h1", "dualpipev"}
            xy = np.c_[front["peak_memory_bytes"] / 2**20, front["samples_per_s"]].astype(float)
            (line,) = [ln for ln in ax.lines if ln.get_gid() == f"pareto-front-line-{impl}"]
            assert line.get_drawstyle() == "steps-post"
            np.testing.assert_allclose(line.get_xydata(), xy)  # in memory order
            (ringed,) = [c for c in ax.collections if c.get_gid() == f"pareto-front-points-{impl}"]
            np.testing.assert_allclose(sorted(map(tuple, ringed.get_offsets())),
                                       sorted(map(tuple, xy)))  # fmt: skip
            (hollow,) = [c for c in ax.collections if c.get_gid() == f"dominated-{impl}"]
            assert len(hollow.get_offsets()) == len(mine) - len(front)
            assert to_rgb(hollow.get_facecolor()[0]) == (1, 1, 1)  # hollow, edge in impl colour
            assert hollow.get_alpha() in (None, 1)  # visible, not faded
        assert sorted(t.get_text() for t in ax.texts) == sorted(d["schedule"])
        points = np.concatenate([c.get_offset_transform().transform(c.get_offsets())
                                 for c in ax.collections])  # fmt: skip
        assert len(points) == len(d)
        for t in ax.texts:
            box = t.get_window_extent(renderer)
            assert ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1)
            assert not any(box.contains(x, y) for x, y in points), t.get_text()


def test_plan_plot_says_it_shows_predictions():
    found = [
        dict(schedule=s, stages_per_rank=v, microbatches=m, samples_per_s=t, fits=True,
             peak_activation_bytes=[0.0], peak_activation_units=[u])
        for s, v, m, t, u in (("zbv", 2, 8, 900.0, 4.0), ("1f1b", 1, 8, 700.0, 4.0),
                              ("v-min", 2, 8, 600.0, 2.0))
    ]  # fmt: skip
    fig = plot_pareto(pareto_frame(found), "peak_memory_units", predicted=True)
    _render(fig)
    (ax,) = fig.axes
    assert fig._suptitle.get_text().startswith("Predicted throughput")
    assert ax.get_ylabel() == "predicted samples/s (simulated)"
    assert ax.get_xlabel() == "peak activation memory (units, max over ranks)"
    assert "M=all" not in ax.get_title()
    assert ax.get_xlim()[0] < 2 < 4 < ax.get_xlim()[1]
    assert sorted(t.get_text() for t in ax.texts) == ["v-min v2 M8", "zbv v2 M8"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["fits: Pareto front"]


def test_pareto_plot_without_memory_says_so():
    runs = _runs().assign(peak_memory_bytes=pd.NA)
    fig = plot_pareto(runs)
    assert [t.get_text() for ax in fig.axes for t in ax.texts] == [
        "no run has both peak_memory_bytes and samples_per_s"
    ]
