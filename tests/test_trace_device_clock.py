"""CUDA-style Kineto traces: actions take their device intervals, waits are the device's gaps,
the bubble is on the device clock; CPU-only traces convert exactly as before."""

import warnings
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
import pytest
from test_trace_kineto import META, PROGRAMS

from vpipe.events import events_frame
from vpipe.metrics.per_run import rank_metrics
from vpipe.trace.kineto import convert
from vpipe.trace.synth import write_synthetic_run

BASE = 1_700_000_000_000_000_000  # synth's baseTimeNanoseconds
STEPS = [3, 4]


def _spans(path: Path, cat: str) -> dict[str, list[tuple[int, int]]]:
    """name -> [(start_ns, end_ns), ...] of one category's complete spans, in time order."""
    out: dict[str, list[tuple[int, int]]] = {}
    for e in sorted(orjson.loads(path.read_bytes())["traceEvents"], key=lambda e: e["ts"]):
        if e.get("ph") == "X" and e["cat"] == cat:
            s = BASE + round(e["ts"] * 1000)
            out.setdefault(e["name"], []).append((s, s + round(e["dur"] * 1000)))
    return out


@pytest.fixture
def cuda_run(tmp_path):
    paths = write_synthetic_run(
        tmp_path, PROGRAMS, steps=STEPS, meta={**META, "device": "cuda"}, gpu_annotations=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # device spans present: no launch-time warning
        trace = convert(paths)
    return paths, trace


def test_every_compute_action_carries_its_device_interval(cuda_run):
    paths, trace = cuda_run
    ev = trace.events
    assert trace.meta["clock"] == "device"
    for rank, program in enumerate(PROGRAMS):
        dev, cpu = (
            _spans(paths[rank], "gpu_user_annotation"),
            _spans(paths[rank], "user_annotation"),
        )
        mine = ev[ev["rank"] == rank]
        compute = mine[mine["kind"].isin(["F", "B", "I", "W"])]
        want = [str(a) for a in program if a.is_compute]
        assert len(compute) == len(want) * len(STEPS)  # one row per action, no duplicates
        assert set(compute["clock"]) == {"device"}
        for i, step in enumerate(STEPS):
            rows = compute[compute["step"] == step]
            assert list(rows["name"]) == want  # device order kept
            for _, r in rows.iterrows():
                d, c = dev[f"PP:{r['name']}"][i], cpu[f"PP:{r['name']}"][i]
                assert (r["start_ns"], r["end_ns"]) == d
                assert (r["launch_start_ns"], r["launch_end_ns"]) == c
                # the synthetic device runs later and longer than the launch
                assert d[0] > c[0] and d[1] - d[0] > c[1] - c[0]
        other = mine[~mine["kind"].isin(["F", "B", "I", "W", "WAIT"])]
        assert set(other["clock"]) == {"host"}
        assert (other["start_ns"] == other["launch_start_ns"]).all()


def test_waits_are_the_device_gap_before_the_consumer(cuda_run):
    """NCCL's wait returns at once on the host (the synthetic host WAIT is 0.3 us); the row
    holds the device's idle time before the consumer: 4 us in the synthetic run."""
    _, trace = cuda_run
    ev = trace.events
    waits = ev[ev["kind"] == "WAIT"]
    assert len(waits) == len(STEPS) * sum(
        a.kind.value.startswith("RECV") for p in PROGRAMS for a in p
    )
    assert set(waits["clock"]) == {"device"}
    assert ((waits["launch_end_ns"] - waits["launch_start_ns"]) == 300).all()
    for _, w in waits.iterrows():
        mine = ev[(ev["rank"] == w["rank"]) & (ev["step"] == w["step"])]
        compute = mine[mine["kind"].isin(["F", "B"])]
        recv = w["name"][5:]
        kind = "F" if "RECV_F" in recv else "B"
        stage, mb = int(w["stage"]), int(w["microbatch"])
        consumer = compute[(compute["kind"] == kind) & (compute["stage"] == stage)
                           & (compute["microbatch"] == mb)]  # fmt: skip
        assert len(consumer) == 1
        start = consumer["start_ns"].iloc[0]
        before = compute[compute["start_ns"] < start]["end_ns"]
        assert w["end_ns"] == start
        expect = max(before.max() if len(before) else w["launch_start_ns"], w["launch_start_ns"])
        assert w["start_ns"] == min(expect, start)
    lengths = (waits["end_ns"] - waits["start_ns"]).to_numpy()
    assert (lengths >= 0).all() and (lengths == 4000).sum() >= len(waits) // 2


def test_bubble_is_computed_on_the_device_clock(cuda_run, tmp_path):
    paths, trace = cuda_run
    r = rank_metrics(trace.events).set_index(["step", "rank"])
    for rank in range(len(PROGRAMS)):
        dev, cpu = (
            _spans(paths[rank], "gpu_user_annotation"),
            _spans(paths[rank], "user_annotation"),
        )
        for i, step in enumerate(STEPS):
            busy = sum(v[i][1] - v[i][0] for k, v in dev.items() if not k.startswith("PP:STEP"))
            s0, s1 = cpu[f"PP:STEP:{step}"][0]
            row = r.loc[(step, rank)]
            assert row["busy_s"] == pytest.approx(busy / 1e9)
            assert row["window_s"] == pytest.approx((s1 - s0) / 1e9)
            assert row["bubble_ratio"] == pytest.approx(1 - busy / (s1 - s0))
    # read on launch spans instead, the same run would claim a quite different bubble
    host = convert(write_synthetic_run(tmp_path / "host", PROGRAMS, steps=STEPS, meta=META))
    host_bubble = rank_metrics(host.events)["bubble_ratio"].mean()
    assert abs(r["bubble_ratio"].mean() - host_bubble) > 0.05


def test_cpu_only_trace_converts_exactly_as_before(tmp_path):
    """The golden rows were written by the converter before device clocks existed."""
    paths = write_synthetic_run(tmp_path, PROGRAMS, steps=[0, 1], meta=META)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = convert(paths)
    ev = trace.events
    golden = pd.read_csv(Path(__file__).parent / "data" / "cpu_trace_events.csv")
    got = ev[list(golden.columns)].astype({"kind": str, "name": str})
    pd.testing.assert_frame_equal(
        got.reset_index(drop=True), golden.astype(got.dtypes.to_dict()), check_categorical=False
    )
    assert set(ev["clock"]) == {"host"} and trace.meta["clock"] == "host"
    assert (ev["launch_start_ns"] == ev["start_ns"]).all()
    assert (ev["launch_end_ns"] == ev["end_ns"]).all()


def test_cuda_trace_without_device_spans_warns_launch_times(tmp_path):
    paths = write_synthetic_run(tmp_path, PROGRAMS, steps=[0], meta={**META, "device": "cuda"})
    with pytest.warns(UserWarning, match="without device spans.*launch times") as got:
        trace = convert(paths)
    assert len(got) == len(paths) and str(paths[0]) in str(got[0].message)
    assert trace.meta["clock"] == "host" and set(trace.events["clock"]) == {"host"}


def test_tables_without_clock_columns_read_as_host_or_sim():
    rows = {
        "run_id": ["a", "a"], "source": ["measured", "simulated"], "impl": ["vpipe"] * 2,
        "schedule": ["zbv"] * 2, "rank": [0, 0], "step": [0, 0], "stage": [0, 0],
        "microbatch": [0, 1], "kind": ["F", "F"], "name": ["0F0", "0F1"],
        "start_ns": [5, 9], "end_ns": [7, 12],
    }  # fmt: skip
    ev = events_frame(rows)
    assert list(ev["clock"].astype(str)) == ["host", "sim"]
    assert np.array_equal(ev["launch_start_ns"], [5, 9])
    assert np.array_equal(ev["launch_end_ns"], [7, 12])
