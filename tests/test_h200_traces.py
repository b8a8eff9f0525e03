"""Real CUDA traces from an H200 (tests/data/h200-traces): every action at the interval of the
GPU work it launched, from any thread, against a brute-force reading of the raw JSON."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from vpipe.events import COMPUTE_KINDS
from vpipe.ir import parse_action
from vpipe.schedules import make_schedule
from vpipe.trace.kineto import convert

DATA = Path(__file__).parent / "data" / "h200-traces"
SCHEDULES = ("zbv", "1f1b")
TOL_NS = 2_000  # 2 us


def _expected(path: Path) -> dict[str, tuple[int, int] | None]:
    """Per compute span name: the extent of the GPU ops whose launch lies inside it and inside
    no span nested in it, launched by any thread but gloo's (None: it launched nothing). The
    slow, obvious reading: every op against every span."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    base = int(doc["baseTimeNanoseconds"])
    ev = doc["traceEvents"]
    gloo = {e["tid"] for e in ev if e.get("name") == "thread_name" and "gloo" in e["args"]["name"]}
    launch = {
        e["args"]["correlation"]: e["ts"]
        for e in ev
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["tid"] not in gloo
    }
    spans = [
        (e["name"], e["ts"], e["ts"] + e["dur"])
        for e in ev
        if e.get("cat") == "user_annotation" and e["name"].startswith("PP:")
    ]
    out: dict[str, tuple[int, int] | None] = {}
    for name, s, t in spans:
        body = name[3:]
        if body.startswith(("WAIT:", "STEP:")) or not parse_action(body).is_compute:
            continue
        nested = [(a, b) for n, a, b in spans if n != name and s <= a and b <= t]
        mine = []
        for op in ev:
            if op.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
            at = launch.get(op["args"]["correlation"])
            if at is None or not s <= at <= t or any(a <= at <= b for a, b in nested):
                continue
            mine.append((op["ts"], op["ts"] + op["dur"]))
        out[body] = (
            (base + round(min(a for a, _ in mine) * 1000), base + round(max(b for _, b in mine) * 1000))
            if mine
            else None
        )
    return out


@pytest.fixture(scope="module", params=SCHEDULES)
def run(request):
    return request.param, convert([DATA / request.param])


def test_every_compute_row_is_its_gpu_work(run):
    schedule, trace = run
    ev = trace.events
    assert trace.meta["clock"] == "device"
    compute = ev[ev["kind"].astype(str).isin(COMPUTE_KINDS)]
    assert set(compute["clock"].astype(str)) == {"device"}
    program = make_schedule(schedule, 2, 4)
    for rank in (0, 1):
        rows = compute[compute["rank"] == rank]
        want = sorted(str(p) for a in program.actions[rank] if a.is_compute for p in a.compute_parts())
        assert sorted(rows["name"].astype(str)) == want  # one row per action part
        expected = _expected(DATA / schedule / f"rank{rank}.pt.trace.json.gz")
        for _, r in rows.iterrows():
            exp = expected[str(r["name"])]
            if exp is None:
                assert r["busy_ns"] == 0 and r["start_ns"] == r["end_ns"]
            else:
                assert abs(r["start_ns"] - exp[0]) <= TOL_NS and abs(r["end_ns"] - exp[1]) <= TOL_NS
                assert 0 < r["busy_ns"] <= r["end_ns"] - r["start_ns"]


def test_rows_are_apart_and_inside_their_step(run):
    _, trace = run
    ev = trace.events
    for (_, _), g in ev.groupby(["rank", "step"], observed=True):
        kind = g["kind"].astype(str)
        step = g[(kind == "other") & (g["name"].astype(str) == "STEP")]
        assert len(step) == 1
        w0, w1 = int(step["start_ns"].iloc[0]), int(step["end_ns"].iloc[0])
        busy = g[kind.isin([*COMPUTE_KINDS, "WAIT"])].sort_values(["start_ns", "end_ns"])
        s, e = busy["start_ns"].to_numpy(), busy["end_ns"].to_numpy()
        assert s.min() >= w0 and e.max() <= w1
        assert (s[1:] >= e[:-1]).all(), "device rows of one rank overlap"


def test_backward_rows_hold_their_kernels_not_a_sliver(run):
    """The loss stage's backward was read as 0.7-0.8 us (the gradient seed's fill, the one
    kernel the main thread launched); autograd's kernels make it hundreds of microseconds."""
    schedule, trace = run
    ev = trace.events
    loss_stage = make_schedule(schedule, 2, 4).loss_stage
    rows = ev[(ev["stage"] == loss_stage) & ev["kind"].astype(str).isin(["B", "I"])]
    assert len(rows) == 4
    assert (rows["busy_ns"] > 20_000).all()
    waits = ev[ev["kind"].astype(str) == "WAIT"]
    assert set(waits["clock"].astype(str)) == {"device"}
    assert (waits["end_ns"] >= waits["start_ns"]).all()


def test_the_bubble_reads_the_device(run):
    from vpipe.metrics.per_run import rank_metrics

    _, trace = run
    r = rank_metrics(trace.events)
    assert np.isfinite(r["bubble_ratio"]).all()
    assert ((r["busy_s"] > 0) & (r["busy_s"] < r["window_s"])).all()
