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


def _owned(path: Path) -> dict[str, list[list[tuple[int, int]]]]:
    """The synthetic ground truth: owner -> per occurrence (step), its GPU ops' intervals."""
    out: dict[str, list[list[tuple[int, int]]]] = {}
    doc = orjson.loads(path.read_bytes())["traceEvents"]
    launch = {e["args"]["correlation"]: e["ts"] for e in doc if e.get("cat") == "cuda_runtime"}
    ops = sorted((e for e in doc if e.get("cat") in ("kernel", "gpu_memcpy")),
                 key=lambda e: launch[e["args"]["correlation"]])  # fmt: skip
    seen: dict[str, float] = {}
    for e in ops:
        owner = e["args"]["synthetic_owner"]
        s = BASE + round(e["ts"] * 1000)
        t = launch[e["args"]["correlation"]]
        if owner not in seen or t - seen[owner] > 50:  # a new step's occurrence
            out.setdefault(owner, []).append([])
        seen[owner] = t
        out[owner][-1].append((s, s + round(e["dur"] * 1000)))
    return out


def _union(intervals: list[tuple[int, int]]) -> int:
    total, reach = 0, None
    for s, e in sorted(intervals):
        lo = s if reach is None else max(s, reach)
        total += max(0, e - lo)
        reach = e if reach is None else max(reach, e)
    return total


@pytest.fixture
def cuda_run(tmp_path):
    paths = write_synthetic_run(
        tmp_path, PROGRAMS, steps=STEPS, meta={**META, "device": "cuda"}, gpu=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # GPU activity present: no launch-time warning
        trace = convert(paths)
    return paths, trace


def test_every_compute_action_carries_the_interval_of_its_gpu_work(cuda_run):
    """Kernels launched from autograd's thread count (the gpu_user_annotation copies, which
    cover the main thread's kernels only, do not decide); gloo's own copy belongs to none."""
    paths, trace = cuda_run
    ev = trace.events
    assert trace.meta["clock"] == "device"
    for rank, program in enumerate(PROGRAMS):
        truth, cpu = _owned(paths[rank]), _spans(paths[rank], "user_annotation")
        annotation = _spans(paths[rank], "gpu_user_annotation")
        mine = ev[ev["rank"] == rank]
        compute = mine[mine["kind"].isin(["F", "B", "I", "W"])]
        want = [str(a) for a in program if a.is_compute]
        assert len(compute) == len(want) * len(STEPS)  # one row per action, no duplicates
        assert set(compute["clock"]) == {"device"}
        for i, step in enumerate(STEPS):
            rows = compute[compute["step"] == step]
            assert list(rows["name"]) == want  # device order kept
            for _, r in rows.iterrows():
                ops, c = truth[r["name"]][i], cpu[f"PP:{r['name']}"][i]
                assert (r["start_ns"], r["end_ns"]) == (ops[0][0], max(e for _, e in ops))
                assert r["busy_ns"] == _union(ops) < r["end_ns"] - r["start_ns"]
                assert (r["launch_start_ns"], r["launch_end_ns"]) == c
                if r["kind"] == "B":  # its annotation copy misses autograd's kernels
                    assert annotation[f"PP:{r['name']}"][i][1] < r["end_ns"]
            ends = rows["end_ns"].to_numpy()
            assert (rows["start_ns"].to_numpy()[1:] >= ends[:-1]).all()  # none overlaps
        other = mine[~mine["kind"].isin(["F", "B", "I", "W", "WAIT"])]
        assert set(other["clock"]) == {"host"}
        assert (other["start_ns"] == other["launch_start_ns"]).all()


def test_waits_end_at_the_received_datas_device_op(cuda_run):
    """NCCL's wait returns at once on the host (the synthetic host WAIT is 0.3 us); the row is
    the device's wait for the data: from its previous work to the NCCL kernel's end (4 us in
    the synthetic run), not to the consumer's start (which adds the launch lag)."""
    paths, trace = cuda_run
    ev = trace.events
    waits = ev[ev["kind"] == "WAIT"]
    assert len(waits) == len(STEPS) * sum(
        a.kind.value.startswith("RECV") for p in PROGRAMS for a in p
    )
    assert set(waits["clock"]) == {"device"}
    assert ((waits["launch_end_ns"] - waits["launch_start_ns"]) == 300).all()
    truth = {rank: _owned(paths[rank]) for rank in range(len(PROGRAMS))}
    lag = 0
    for _, w in waits.iterrows():
        i = STEPS.index(int(w["step"]))
        (data,) = truth[int(w["rank"])][f"RECV:{w['name'][5:]}"][i]
        assert w["end_ns"] == max(data[1], w["start_ns"])  # empty if there before the ask
        mine = ev[(ev["rank"] == w["rank"]) & (ev["step"] == w["step"])]
        compute = mine[mine["kind"].isin(["F", "B"])]
        consumer = compute[compute["launch_start_ns"] <= w["launch_start_ns"]].iloc[-1]
        lag += consumer["start_ns"] - w["end_ns"]
        before = compute[compute["launch_end_ns"] <= w["launch_start_ns"]]["end_ns"]
        assert w["start_ns"] == max(before.max() if len(before) else 0, w["launch_start_ns"])
    assert lag > 0  # the consumer started after its data: launch lag, left out of the wait
    lengths = (waits["end_ns"] - waits["start_ns"]).to_numpy()
    assert (lengths >= 0).all() and (lengths == 4000).sum() >= len(waits) // 2


def test_an_action_that_launches_nothing_is_an_empty_device_row(tmp_path):
    nothing = frozenset({"1B1"})
    paths = write_synthetic_run(tmp_path, PROGRAMS, steps=[0], meta={**META, "device": "cuda"},
                                gpu=True, launches_nothing=nothing)  # fmt: skip
    ev = convert(paths).events
    row = ev[ev["name"] == "1B1"].iloc[0]
    assert row["clock"] == "device" and row["busy_ns"] == 0
    assert row["start_ns"] == row["end_ns"] >= row["launch_end_ns"]
    rank1 = ev[(ev["rank"] == 1) & ev["kind"].isin(["F", "B"])].sort_values("start_ns")
    assert list(rank1["name"]) == [str(a) for a in PROGRAMS[1] if a.is_compute]
    before = rank1[rank1["name"] == "1F1"].iloc[0]
    assert row["start_ns"] >= before["end_ns"]  # after the device's earlier work


def test_bubble_is_computed_on_the_device_clock(cuda_run, tmp_path):
    paths, trace = cuda_run
    r = rank_metrics(trace.events).set_index(["step", "rank"])
    for rank in range(len(PROGRAMS)):
        truth, cpu = _owned(paths[rank]), _spans(paths[rank], "user_annotation")
        for i, step in enumerate(STEPS):
            busy = sum(max(e for _, e in v[i]) - v[i][0][0]
                       for k, v in truth.items() if k and not k.startswith("RECV:"))  # fmt: skip
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
    assert (ev["busy_ns"] == ev["end_ns"] - ev["start_ns"]).all()
    assert (ev["launch_start_ns"] == ev["start_ns"]).all()
    assert (ev["launch_end_ns"] == ev["end_ns"]).all()


def test_cuda_trace_without_device_spans_warns_launch_times(tmp_path):
    paths = write_synthetic_run(tmp_path, PROGRAMS, steps=[0], meta={**META, "device": "cuda"})
    with pytest.warns(UserWarning, match="without GPU activity.*launch times") as got:
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
