"""The split backward's cost over a fused B: measured, probed, and charged by the cost model."""

import numpy as np
import pandas as pd
import pytest

from vpipe.predict.calibrate import Calibration, calibrate, predict
from vpipe.predict.pieces import split_sizes
from vpipe.predict.split_cost import in_run_ratio, split_backward_ratio, split_factors
from vpipe.schedules import make_schedule
from vpipe.sim import CostModel, simulate

# per MLP block, microseconds: F, a fused B, and how I + W of one B split (8:6)
F, B_FUSED, RATIO = 10.0, 14.0, 1.25
I_SHARE = 8 / 14


def truth(n_stages: int, ratio: float = RATIO, n_units: int = 4) -> CostModel:
    """Costs as the model sees them: a fused B per block everywhere; I + W that times
    ``ratio`` past the first stage, whose backward (input gradient none) is all W."""
    per_stage = {}
    for s, n in enumerate(split_sizes(n_units, n_stages)):
        fused = B_FUSED * n
        split = fused * (ratio if s else 1.0)
        i = split * I_SHARE if s else 0.0
        per_stage[s] = {"f": F * n, "b": i, "w": split - i, "B": fused}
    return CostModel(per_stage=per_stage)


def measured(name: str, n_stages: int) -> pd.DataFrame:
    sched = make_schedule(name, 2, 4)
    assert sched.n_stages == n_stages
    return simulate(sched, truth(n_stages)).to_events(name, sched, time_unit_ns=1000)


def test_factors_and_the_row_reader():
    assert split_factors(3, None).tolist() == [1, 1, 1]
    assert split_factors(3, 1.2).tolist() == pytest.approx([1, 1.2, 1.2])
    assert split_backward_ratio({"split_backward_ratio": 1.13}) == 1.13
    for bad in (None, pd.NA, float("nan"), -1.0, 0.0, "fast"):
        assert split_backward_ratio({"split_backward_ratio": bad}) is None
    assert split_backward_ratio({}) is None

    class Row:
        split_backward_ratio = 1.1

    assert split_backward_ratio(Row()) == 1.1


def test_in_run_ratio_needs_b_beside_i_and_w_past_the_first_stage():
    b, w = np.array([0.0, 8.0, 10.0]), np.array([20.0, 6.0, 8.0])
    assert in_run_ratio(b, w, None) is None
    assert in_run_ratio(b, w, np.array([20.0, np.nan, np.nan])) is None  # stage 0 only
    assert in_run_ratio(b, w, np.array([20.0, 10.0, 15.0])) == pytest.approx((1.4 + 1.2) / 2)


def test_a_b_only_calibration_predicts_split_schedules_with_the_ratio():
    """Calibrated on 1f1b (B only, 2 stages of 2 blocks) with the probed ratio, zbv and
    zb-h1 (I and W) come out as simulated with the true costs; without it, short."""
    cal = calibrate(measured("1f1b", 2), w_share=1 - I_SHARE, split_ratio=RATIO)
    assert cal.split_ratio == RATIO
    for name in ("zbv", "zb-h1", "interleaved-1f1b"):
        sched = make_schedule(name, 2, 4)
        want = simulate(sched, truth(sched.n_stages)).makespan
        assert predict(cal, sched, n_units=4).makespan == pytest.approx(want)
    zbv = make_schedule("zbv", 2, 4)
    unknown = calibrate(measured("1f1b", 2), w_share=1 - I_SHARE)
    assert unknown.split_ratio is None
    assert predict(unknown, zbv, 4).makespan < predict(cal, zbv, 4).makespan


def test_an_i_w_calibration_predicts_fused_schedules_without_the_ratio():
    """Calibrated on zb-h1 (I and W only), 1f1b's B is I + W over the ratio."""
    cal = calibrate(measured("zb-h1", 2), split_ratio=RATIO)
    cost = cal.cost_model(make_schedule("1f1b", 2, 4))
    assert cost.per_stage[1]["B"] == pytest.approx(2 * B_FUSED)
    assert cost.per_stage[1]["b"] + cost.per_stage[1]["w"] == pytest.approx(2 * B_FUSED * RATIO)
    assert cost.per_stage[0]["B"] == pytest.approx(2 * B_FUSED)  # no input gradient: no ratio
    for name in ("1f1b", "interleaved-1f1b", "zbv"):
        sched = make_schedule(name, 2, 4)
        want = simulate(sched, truth(sched.n_stages)).makespan
        assert predict(cal, sched, n_units=4).makespan == pytest.approx(want)


def test_a_run_with_b_beside_i_and_w_measures_its_own_ratio():
    """dualpipev runs B and I/W on the same stages: the run's own ratio wins over a probe's,
    and its B is what 1f1b's stages cost."""
    cal = calibrate(measured("dualpipev", 4), split_ratio=3.0)
    assert cal.split_ratio == pytest.approx(RATIO)
    assert cal.to_dict()["split_ratio"] == pytest.approx(RATIO)
    one = make_schedule("1f1b", 2, 4)
    assert predict(cal, one, 4).makespan == pytest.approx(simulate(one, truth(2)).makespan)


def test_unknown_ratio_leaves_the_cost_model_as_it_was():
    cal = Calibration(np.array([10.0, 10.0]), np.array([0.0, 7.0]), np.array([14.0, 7.0]),
                      0.0, 0.0, 0.0, 0.5)  # fmt: skip
    cost = cal.cost_model(make_schedule("zb-h1", 2, 4))
    for s in (0, 1):
        stage = cost.per_stage[s]
        assert stage["b"] + stage["w"] == pytest.approx(stage["B"]) == 14.0
