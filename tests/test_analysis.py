"""Metrics from event tables, checked on small hand-made tables with known answers."""

import math

import pandas as pd
import pytest

from vpipe.events import events_frame, memory_frame
from vpipe.metrics.catalogue import summarize
from vpipe.metrics.per_run import (
    headline_peak_bytes,
    pareto_front,
    rank_metrics,
    step_breakdown,
    step_metrics,
)


def ev(rank, kind, start, end, step=0, stage=0, mb=0, name=None, run="r"):
    return dict(run_id=run, source="simulated", impl="sim", schedule="x", rank=rank, step=step,
                stage=stage, microbatch=mb, kind=kind, name=name or kind, start_ns=start,
                end_ns=end)  # fmt: skip


def test_busy_idle_bubble_both_definitions():
    rows = [
        ev(0, "F", 0, 10), ev(0, "B", 20, 40),
        ev(1, "WAIT", 0, 10), ev(1, "F", 10, 20, stage=1), ev(1, "B", 15, 25, stage=1),
        ev(1, "SEND_B", 25, 26, stage=1),
    ]  # fmt: skip
    r = rank_metrics(events_frame(rows)).set_index("rank")
    assert r.loc[0, "busy_s"] * 1e9 == pytest.approx(30)
    assert r.loc[1, "busy_s"] * 1e9 == pytest.approx(15)  # overlapping spans count once
    assert r.loc[0, "bubble_ratio"] == pytest.approx(0.25)
    assert r.loc[1, "bubble_ratio"] == pytest.approx(1 - 15 / 40)
    assert r.loc[1, "bubble_ratio_excl_skew"] == pytest.approx(0.0)
    assert r.loc[1, "comm_wait_s"] * 1e9 == pytest.approx(10)
    s = step_metrics(events_frame(rows)).iloc[0]
    assert s["step_time_s"] * 1e9 == pytest.approx(40)
    assert s["bubble_ratio"] == pytest.approx(1 - 45 / 80)
    assert s["bubble_ratio_excl_skew"] == pytest.approx(1 - 45 / 55)


def test_step_spans_define_the_window_when_present():
    rows = []
    for k, length in enumerate([100, 200, 300, 400]):
        t0 = 1000 * k
        for rank in (0, 1):
            rows.append(ev(rank, "other", t0, t0 + length - 10 * rank, step=k, name="STEP", mb=-1))
            rows.append(ev(rank, "F", t0 + 10, t0 + 30, step=k))
    s = step_metrics(events_frame(rows))
    assert list(s["step_time_s"] * 1e9) == pytest.approx([100, 200, 300, 400])
    assert s.loc[0, "bubble_ratio"] == pytest.approx(1 - 40 / (100 + 90))
    mem = memory_frame(
        dict(run_id="r", source="measured", rank=[0, 1, 1, 0], step=0, t_ns=[1, 2, 3, 4],
             bytes=[5, 70, 9, 1000], what=["cpu_allocated", "cpu_allocated", "activations", "rss"])
    )  # fmt: skip
    out = summarize(events_frame(rows), mem, batch=8, tokens_per_sample=16)
    # profiled steps only: their figures carry their own names; the step time and throughput
    # are the timed steps' and a trace has none
    assert out["profiled_step_time_s"] * 1e9 == pytest.approx(250)
    assert out["profiled_step_time_q1_s"] * 1e9 == pytest.approx(175)
    assert out["profiled_step_time_q3_s"] * 1e9 == pytest.approx(325)
    assert math.isnan(out["step_time_s"]) and math.isnan(out["samples_per_s"])
    assert math.isnan(out["tokens_per_s"])
    assert out["peak_memory_bytes"] == 70  # allocation tracking wins over RSS
    assert out["peak_activations_bytes"] == 9 and out["peak_rss_bytes"] == 1000
    assert headline_peak_bytes(mem[mem["what"] == "rss"]) == 1000
    assert headline_peak_bytes(None) is None


def test_empty_and_no_batch():
    out = summarize(events_frame([]))
    assert out["steps"] == 0 and math.isnan(out["step_time_s"])
    assert math.isnan(summarize(events_frame([ev(0, "F", 0, 5)]))["samples_per_s"])


def test_pareto_front_keeps_ties_and_drops_dominated_rows():
    df = pd.DataFrame(
        [
            ("a", 100, 10.0),  # tied with b on both: both on the front
            ("b", 100, 10.0),
            ("same-memory-slower", 100, 8.0),  # beaten by a (equal x, lower y)
            ("same-speed-more-memory", 200, 10.0),  # beaten by a (higher x, equal y)
            ("dominated", 260, 12.0),  # beaten by f on both
            ("f", 250, 15.0),
            ("e", 300, 20.0),
            ("no-memory", None, 99.0),  # missing x: not a candidate
        ],
        columns=["name", "mem", "thru"],
    ).astype({"mem": "Int64"})
    front = pareto_front(df, "mem", "thru")
    assert list(front["name"]) == ["a", "b", "f", "e"]
    assert list(front.index) == [0, 1, 5, 6]  # the input's rows, sorted by memory
    assert pareto_front(df.iloc[:0], "mem", "thru").empty


def test_step_breakdown_adds_up_to_the_window():
    """compute, wait, post and other split each rank's step window, overlaps counted once."""
    rows = [
        ev(0, "other", 0, 100, name="STEP"), ev(0, "F", 0, 30), ev(0, "SEND_F", 32, 34),
        ev(0, "WAIT", 40, 80), ev(0, "B", 80, 96), ev(0, "RECV_B", 85, 90),
        ev(1, "other", 0, 100, name="STEP"), ev(1, "F", 10, 50, stage=1),
    ]  # fmt: skip
    b = step_breakdown(events_frame(rows)).set_index("rank")
    ns = 1e-9
    assert b.loc[0, "compute"] == pytest.approx(46 * ns)  # F 30 + B 16
    assert b.loc[0, "wait"] == pytest.approx(40 * ns)
    assert b.loc[0, "post"] == pytest.approx(2 * ns)  # the RECV inside B counts as compute
    assert b.loc[0, "other"] == pytest.approx(12 * ns)
    assert b.loc[1, "compute"] == pytest.approx(40 * ns) and b.loc[1, "other"] == pytest.approx(
        60 * ns
    )
    parts = b[["compute", "wait", "post", "other"]].sum(axis=1)
    assert (parts - b["window"]).abs().max() < 1e-15
