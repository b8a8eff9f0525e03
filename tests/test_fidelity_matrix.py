"""bench.fidelity_matrix's view of the timing itself: how well each timed ratio is known, and
which predictions fall outside what the timing can tell from exact."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from bench.fidelity_matrix import outside_timing, timed_intervals


def test_a_prediction_is_judged_against_its_timed_ratios_interval(tmp_path):
    rng = np.random.default_rng(0)
    a = 1.0 + 0.01 * rng.standard_normal(40)
    b = 1.2 + 0.01 * rng.standard_normal(40)
    few = 1.1 + 0.2 * rng.standard_normal(6)  # a config timed too few, noisy steps
    rows = [("a", t) for t in a] + [("b", t) for t in b] + [("c", t) for t in few]
    steps = pd.DataFrame(rows, columns=["schedule", "step_time_s"]).assign(impl="vpipe")
    steps = pd.concat([steps, steps.assign(impl="torch", step_time_s=9.0)])  # another impl
    steps.to_parquet(tmp_path / "steps.parquet")
    timed = {"a": float(np.median(a)), "b": float(np.median(b)), "c": float(np.median(few))}
    got = timed_intervals(tmp_path / "steps.parquet", "vpipe", timed)
    assert got["own"]["a"][0] == 40 and got["own"]["c"][0] == 6
    assert got["own"]["a"][1] < 0.01 < got["own"]["c"][1]  # 40 quiet steps pin the median
    lo, hi = got["low"].loc["a", "b"], got["high"].loc["a", "b"]
    assert 0.98 < lo < 1 < hi < 1.02  # around the stored medians' ratio
    assert hi - lo < got["high"].loc["a", "c"] - got["low"].loc["a", "c"]
    labels = list(timed)
    errors = pd.DataFrame(0.0, index=labels, columns=labels)
    errors.loc["a", "b"] = 0.001  # inside the interval
    errors.loc["b", "a"] = -0.2  # far outside it
    errors.loc["a", "c"] = 0.05  # inside the wide interval of the noisy config
    beyond = outside_timing(errors, got)
    assert len(beyond) == 1
    assert beyond[0] == pytest.approx(got["low"].loc["b", "a"] - 0.8)
