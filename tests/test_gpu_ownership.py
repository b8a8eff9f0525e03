"""Ownership of a CUDA trace's GPU ops by message, thread and stream, on synthetic NCCL traces
posted as the runtime posts (batches of adjacent communication actions launched from the last
one's span, grouped kernels carrying sends and receives together, a data loader's thread, side
streams): every WAIT ends at its own message's kernel, every compute row holds only its
threads' compute-stream work, other work is its own row kind and counts as device busy."""

from __future__ import annotations

import numpy as np
import orjson
import pandas as pd
import pytest

from bench.gpu_device_checks import union_ns
from vpipe.events import COMPUTE_KINDS
from vpipe.ir.lowering import lower
from vpipe.metrics.per_run import rank_metrics
from vpipe.schedules import make_schedule
from vpipe.trace.kineto import convert
from vpipe.trace.synth_nccl import write_nccl_run

US = 1000  # ns
TOL = 2 * US
CASES = {
    "dualpipev-grouped": dict(schedule=("dualpipev", 4, 8), grouped=True, launch_lag_us=40.0),
    "zbv-per-message": dict(schedule=("zbv", 2, 4), grouped=False, launch_lag_us=40.0),
    "1f1b-unnamed-loader-side": dict(schedule=("1f1b", 2, 4), loader_named=False, side_stream=True),
}


def _truth(paths):
    """Per rank: {RECV action: its kernel's end}, {action: (first start, last end, busy)} of
    its compute-stream kernels, and the other work's total ns, from the ops' ground truth."""
    out = {}
    for rank, path in enumerate(paths):
        doc = orjson.loads(path.read_bytes())
        base = doc["baseTimeNanoseconds"]
        lands, rows, other = {}, {}, 0
        for e in doc["traceEvents"]:
            a = e.get("args") or {}
            if e.get("cat") not in ("kernel", "gpu_memcpy"):
                continue
            s = base + round(e["ts"] * 1000)
            end = s + round(e["dur"] * 1000)
            for m in a.get("synthetic_messages", []):
                lands[m] = end
            if a.get("synthetic_owner"):
                o = a["synthetic_owner"]
                f, last, busy = rows.get(o, (s, end, 0))
                rows[o] = (min(f, s), max(last, end), busy + end - s)
            elif "synthetic_messages" not in a:
                other += end - s
        out[rank] = (lands, rows, other)
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    kw = dict(CASES[request.param])
    name, p, m = kw.pop("schedule")
    program = lower(make_schedule(name, p, m))
    paths = write_nccl_run(tmp_path_factory.mktemp(request.param), program.actions, steps=(0,),
                           meta={"schedule": name, "run_id": request.param}, **kw)  # fmt: skip
    return convert(paths).events, _truth(paths), program


def test_every_wait_ends_at_its_messages_kernel(case):
    ev, truth, _ = case
    waits = ev[ev["kind"].astype(str) == "WAIT"]
    assert len(waits) and set(waits["clock"].astype(str)) == {"device"}
    for r in waits.itertuples():
        lands = truth[r.rank][0][str(r.name).removeprefix("WAIT:")]
        # it ends where its data landed, or is empty where the data was there first
        assert abs(r.end_ns - max(lands, r.start_ns)) <= TOL, (r.rank, r.name, r.step)
    assert (waits["busy_ns"] > 0).sum() >= 2  # waits that the device really waited out


def test_every_compute_row_holds_only_its_threads_compute_stream_work(case):
    ev, truth, _ = case
    compute = ev[ev["kind"].astype(str).isin(COMPUTE_KINDS)]
    assert (compute["clock"].astype(str) == "device").all()
    for r in compute.itertuples():
        first, last, busy = truth[r.rank][1][str(r.name)]
        assert abs(r.start_ns - first) <= TOL and abs(r.end_ns - last) <= TOL, (r.rank, r.name)
        assert abs(r.busy_ns - busy) <= TOL


def test_no_two_compute_rows_of_a_rank_overlap(case):
    ev = case[0]
    compute = ev[ev["kind"].astype(str).isin(COMPUTE_KINDS)].sort_values("start_ns")
    for _, g in compute.groupby("rank", observed=True):
        assert (g["start_ns"].to_numpy()[1:] >= g["end_ns"].to_numpy()[:-1]).all()


def test_other_gpu_work_is_its_own_row_and_device_busy(case):
    ev, truth, _ = case
    gpu = ev[ev["kind"].astype(str) == "GPU"]
    assert len(gpu) and (gpu["clock"].astype(str) == "device").all()
    names = set(gpu["name"].astype(str))
    assert any("pt_data_loader" in n or n.startswith("thread ") for n in names)
    compute = ev[ev["kind"].astype(str).isin(COMPUTE_KINDS)]
    m = rank_metrics(ev).set_index(["rank", "step"])
    for (rank, step), g in gpu.groupby(["rank", "step"], observed=True):
        c = compute[(compute["rank"] == rank) & (compute["step"] == step)]
        both = pd.concat([c, g])
        union = union_ns(both["start_ns"], both["end_ns"])
        assert m.loc[(rank, step), "busy_s"] == pytest.approx(union / 1e9)


def test_side_stream_work_is_shown_apart():
    program = lower(make_schedule("1f1b", 2, 2))
    from vpipe.trace.synth_nccl import nccl_trace

    doc = nccl_trace(program.actions[1], 1, side_stream=True, loader=False)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank1.pt.trace.json"
        path.write_bytes(orjson.dumps(doc))
        ev = convert([path]).events
    side = ev[ev["kind"].astype(str) == "GPU"]
    assert sorted(side["name"].astype(str)) == ["1B0 stream 9", "1B1 stream 9"]
    b = ev[ev["kind"].astype(str) == "B"]
    assert (b["busy_ns"] == 3 * 10 * US).all()  # its three compute-stream kernels only


def test_which_threads_launch_for_actions():
    """The spans' thread; autograd's by its name; an unnamed thread (or one carrying the
    process's name) by launching only inside compute spans; a named thread never."""
    import numpy as np

    from vpipe.trace.gpu_owners import action_threads

    compute = (np.array([0, 100]), np.array([50, 150]))
    tid = np.array([1, 2, 3, 4, 5, 6, 6])
    at = np.array([60, 10, 70, 20, 30, 20, 120])
    names = {2: "thread 2 (pt_autograd_0)", 4: "thread 4 (pt_data_loader)",
             5: "thread 5 (python3)", 6: ""}  # fmt: skip
    # 3: unnamed, launched between compute spans; 5, 6: unnamed, only inside them
    assert action_threads(tid, at, {1}, compute, names) == {1, 2, 5, 6}


def test_merged_intervals_is_the_union_walked_interval_by_interval():
    """The vectorised union against a plain walk over the sorted intervals (touching ones
    joined), on random sets, empty ones included."""
    from vpipe.trace.gpu_owners import merged_intervals, union_length

    rng = np.random.default_rng(7)
    for _ in range(500):
        n = int(rng.integers(0, 12))
        s = rng.integers(0, 100, n)
        e = s + rng.integers(0, 30, n)
        walked: list[list[int]] = []
        for a, b in sorted(zip(s.tolist(), e.tolist(), strict=True)):
            if walked and a <= walked[-1][1]:
                walked[-1][1] = max(walked[-1][1], b)
            else:
                walked.append([a, b])
        m0, m1 = merged_intervals(s, e)
        assert [[int(a), int(b)] for a, b in zip(m0, m1, strict=True)] == walked
        assert union_length(s, e) == sum(b - a for a, b in walked)
