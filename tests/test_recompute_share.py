"""What selective recomputation reruns, measured: the runtime marks the recomputable calls
while profiling (``PP:RECOMPUTABLE``), calibration reads their share of each stage's forward,
and the simulator and ``plan --recompute selective`` rerun that share in each B and I."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from test_runtime import _one_thread  # noqa: F401 (autouse: one thread per test)

from vpipe.events import RECOMPUTABLE, events_frame
from vpipe.predict.calibrate import calibrate
from vpipe.predict.recompute_share import recomputable_us, selective_shares
from vpipe.schedules import make_schedule
from vpipe.sim import CostModel, simulate


def _with_marks(events: pd.DataFrame, marks: list[tuple[int, int, int]]) -> pd.DataFrame:
    """``events`` plus RECOMPUTABLE rows (rank, start_ns, end_ns) in step 0."""
    rows = [
        {"run_id": "r", "source": "measured", "impl": "vpipe", "schedule": "zbv", "rank": r,
         "step": 0, "stage": -1, "microbatch": -1, "kind": "other", "name": RECOMPUTABLE,
         "start_ns": s, "end_ns": e}  # fmt: skip
        for r, s, e in marks
    ]
    return events_frame(pd.concat([events, events_frame(rows)], ignore_index=True))


def _simulated(f: float = 100.0) -> tuple[object, pd.DataFrame]:
    zbv = make_schedule("zbv", 2, 4)
    costs = CostModel(f=f, b=90, w=70, comm_latency=5, unit="stage")
    events = simulate(zbv, costs).to_events("r", zbv, time_unit_ns=1000)
    return zbv, events.assign(source="measured", clock="host")


def test_the_share_is_the_time_in_marks_inside_each_forward():
    zbv, events = _simulated()
    fwd = events[events["kind"].astype(str) == "F"]
    marks = []
    for r in fwd.itertuples():  # stage s: (s + 1) x 10 us of marks in two pieces
        dur = (r.stage + 1) * 10_000
        marks += [(r.rank, r.start_ns + 1_000, r.start_ns + 1_000 + dur // 2),
                  (r.rank, r.end_ns - 1_000 - dur // 2, r.end_ns - 1_000)]  # fmt: skip
    first = fwd.sort_values("start_ns").iloc[0]  # outside every forward: not counted
    marks.append((int(first["rank"]), int(first["start_ns"]) - 50_000, int(first["start_ns"]) - 40_000))
    ev = _with_marks(events, marks)
    np.testing.assert_allclose(recomputable_us(ev, 4), [10, 20, 30, 40])
    cal = calibrate(ev)
    np.testing.assert_allclose(selective_shares(cal, 4, 4), [0.1, 0.2, 0.3, 0.4])
    # two stages of two pieces each: their marks over their forwards
    np.testing.assert_allclose(selective_shares(cal, 2, 4), [30 / 200, 70 / 200])


def test_without_marks_there_is_no_measured_share():
    _, events = _simulated()
    assert recomputable_us(events, 4) is None
    assert calibrate(events).recomputable is None


def test_plan_reruns_the_measured_share_in_each_backward():
    """Calibrated on a run whose forwards spent 40% in recomputable calls, selective costs
    0.4 forwards more in each B and I than the run without: the step grows by what the
    simulator gives with that share, not by attention's share of the multiply-adds."""
    from vpipe.predict.plan import Budget, calibrated_costs, plan

    zbv, events = _simulated()
    fwd = events[events["kind"].astype(str) == "F"]
    marks = [(r.rank, r.start_ns, r.start_ns + 40_000) for r in fwd.itertuples()]
    sizes = {"vocab": 512, "d_model": 128, "n_heads": 4, "n_layers": 2, "seq_len": 64}
    meta = {"model": "gpt", "sizes": sizes, "batch": 32, "stages": 4, "dtype": "fp32"}
    costs = calibrated_costs(_with_marks(events, marks), {0: 8e6, 1: 14e6}, zbv, meta)
    kw = {"microbatches": [4], "schedules": ["zbv"]}
    got = plan(costs, 2, 32, Budget(1e12), recompute=("none", "selective"), **kw)
    step = {c["recompute"]: c["predicted_step_s"] for c in got["candidates"]}
    cm = costs.cost_model(zbv, 8)
    want = [simulate(zbv, CostModel(**{**cm.to_dict(), "recompute": r})).makespan
            for r in (0.0, [0.4] * 4)]  # fmt: skip
    assert step["selective"] / step["none"] == pytest.approx(want[1] / want[0], rel=1e-6)
    assert want[1] > want[0] * 1.1


def test_a_profiled_gpt_run_marks_attention_and_the_activation_functions(tmp_path):
    """The runtime's spans, read back: every layer's forward holds two marks (attention's
    core, the GELU), the head-only stage none, and they are a part of the forward."""
    from vpipe.models import build_model
    from vpipe.runtime import Pipeline
    from vpipe.trace.kineto import convert
    from vpipe.trace.record import StepProfiler

    sched = make_schedule("1f1b", 1, 2)
    sizes = {"vocab": 64, "d_model": 32, "n_heads": 2, "n_layers": 2, "seq_len": 16}
    bm = build_model("gpt", 1, 0, **sizes)
    pipe = Pipeline(sched, {0: bm.stages[0]}, bm.loss_fn)
    x, y = bm.make_batch(4, seed=0)
    with StepProfiler(tmp_path, 0, wait=0, warmup=1, active=1) as prof:
        for _ in range(2):
            pipe.step(x, y)
            prof.step()
    ev = convert([tmp_path]).events
    marks = ev[ev["name"].astype(str) == RECOMPUTABLE]
    assert len(marks) == 2 * 2 * 2  # 2 microbatches x 2 layers x (attention, GELU)
    share = selective_shares(calibrate(ev), 1, 4)
    assert 0 < share[0] < 1
    pipe.step(x, y)  # not profiling: nothing marks, nothing fails
    assert not torch._C._autograd._profiler_enabled()


def test_full_recompute_reruns_the_forward_as_probed_alone():
    """A run whose probe timed each stage's forward alone at half its F in the pipeline: full
    recomputation reruns half an F in each B and I (the pipeline's own extra is not rerun);
    without the probe, the whole F; a stage not probed, its whole F."""
    import json

    from vpipe.predict.plan import Budget, calibrated_costs, plan
    from vpipe.predict.recompute_share import forward_alone_us, full_shares

    zbv, events = _simulated()
    sizes = {"vocab": 512, "d_model": 128, "n_heads": 4, "n_layers": 2, "seq_len": 64}
    meta = {"model": "gpt", "sizes": sizes, "batch": 32, "stages": 4, "dtype": "fp32"}
    probed = {**meta, "forward_alone_us": json.dumps([50.0, 50.0, None, 50.0])}
    np.testing.assert_allclose(forward_alone_us(probed), [50, 50, np.nan, 50])
    assert forward_alone_us(meta) is None and forward_alone_us({"forward_alone_us": "[]"}) is None
    cal = calibrate(events)
    assert full_shares(cal, 4, 4) == 1.0
    cal.forward_alone = forward_alone_us(probed)
    np.testing.assert_allclose(full_shares(cal, 4, 4), [0.5, 0.5, 1.0, 0.5])
    np.testing.assert_allclose(full_shares(cal, 2, 4), [0.5, 0.75])  # two pieces each
    kw = {"microbatches": [4], "schedules": ["zbv"]}
    step = {}
    for name, m in (("plain", meta), ("probed", probed)):
        costs = calibrated_costs(events, {0: 8e6, 1: 14e6}, zbv, m)
        got = plan(costs, 2, 32, Budget(1e12), recompute=("none", "full"), **kw)
        step[name] = {c["recompute"]: c["predicted_step_s"] for c in got["candidates"]}
        cm = costs.cost_model(zbv, 8)
        share = 1.0 if name == "plain" else [0.5, 0.5, 1.0, 0.5]
        want = [simulate(zbv, CostModel(**{**cm.to_dict(), "recompute": r})).makespan
                for r in (0.0, share)]  # fmt: skip
        assert step[name]["full"] / step[name]["none"] == pytest.approx(want[1] / want[0], rel=1e-6)
    assert step["probed"]["full"] < step["plain"]["full"]
