"""How well the timed ratios that judge a fidelity table are known
(vpipe.predict.timing_noise), from given steps and from a sweep's."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from vpipe.predict.timing_noise import (
    outside_timing,
    ratio_intervals,
    sweep_intervals,
    timing_sentence,
)


def _steps() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"a": 1.0 + 0.01 * rng.standard_normal(40),
            "b": 1.2 + 0.01 * rng.standard_normal(40),
            "c": 1.1 + 0.2 * rng.standard_normal(6)}  # too few, noisy steps  # fmt: skip


def test_a_prediction_is_judged_against_its_timed_ratios_interval():
    times = _steps()
    timed = {k: float(np.median(v)) for k, v in times.items()}
    got = ratio_intervals(times, timed)
    assert got["own"]["a"][0] == 40 and got["own"]["c"][0] == 6
    assert got["own"]["a"][1] < 0.01 < got["own"]["c"][1]  # 40 quiet steps pin the median
    lo, hi = got["low"].loc["a", "b"], got["high"].loc["a", "b"]
    assert 0.98 < lo < 1 < hi < 1.02  # around the judged medians' ratio
    assert hi - lo < got["high"].loc["a", "c"] - got["low"].loc["a", "c"]
    errors = pd.DataFrame(0.0, index=list(timed), columns=list(timed))
    errors.loc["a", "b"] = 0.001  # inside the interval
    errors.loc["b", "a"] = -0.2  # far outside it
    errors.loc["a", "c"] = 0.05  # inside the wide interval of the noisy config
    beyond = outside_timing(errors, got)
    assert len(beyond) == 1
    assert beyond[0] == pytest.approx(got["low"].loc["b", "a"] - 0.8)
    said = timing_sentence(errors, got)
    assert "1 of 6 predictions lie outside them, by at most" in said


def test_too_few_steps_say_so():
    times = {"a": np.ones(3), "b": np.full(3, 2.0)}  # under MIN_SAMPLES: no interval
    got = ratio_intervals(times, {"a": 1.0, "b": 2.0})
    errors = pd.DataFrame([[0.0, 0.5], [0.5, 0.0]], index=["a", "b"], columns=["a", "b"])
    assert outside_timing(errors, got) == []
    assert "too few to bound" in timing_sentence(errors, got)


def test_a_sweeps_intervals_take_one_implementation_and_microbatch_count():
    times = _steps()
    rows = [(k, t) for k, v in times.items() for t in v]
    steps = pd.DataFrame(rows, columns=["schedule", "step_time_s"]).assign(impl="vpipe",
                                                                          microbatches=4)
    others = [steps.assign(impl="torch", step_time_s=9.0), steps.assign(microbatches=8,
                                                                        step_time_s=7.0)]
    timed = {k: float(np.median(v)) for k, v in times.items()}
    runs = pd.DataFrame([(k, t) for k, t in timed.items()], columns=["schedule", "step_time_s"])
    runs = pd.concat([runs.assign(impl="vpipe", microbatches=4),
                      runs.assign(impl="torch", microbatches=4, step_time_s=9.0)])
    got = sweep_intervals(pd.concat([steps, *others]), runs, "vpipe", 4)
    assert got["own"] == ratio_intervals(times, timed)["own"]
