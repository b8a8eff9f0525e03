"""The statistics of A-vs-B figures: median of pairwise ratios and ratio of medians with a
seeded percentile-bootstrap interval, the verdict, and the outlier flag."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpipe.stats import (
    MIN_SAMPLES,
    OUTLIER_FACTOR,
    outliers,
    paired_ratio,
    ratio_of_medians,
)

RNG = np.random.default_rng(7)
TIMES = 0.05 * (1 + 0.1 * RNG.random(9))  # nine noisy step times around 50 ms


@pytest.mark.parametrize("estimate", [paired_ratio, ratio_of_medians])
def test_identical_samples_give_one_and_no_significant_difference(estimate):
    r = estimate(TIMES, TIMES.copy())
    assert r.value == pytest.approx(1.0)
    assert r.low <= 1 <= r.high
    assert r.verdict() == "no significant difference"
    assert r.n == 9 and r.outliers == 0


def test_independent_samples_of_one_distribution_are_no_significant_difference():
    other = 0.05 * (1 + 0.1 * np.random.default_rng(8).random(9))
    r = ratio_of_medians(TIMES, other)
    assert r.low < 1 < r.high and r.verdict() == "no significant difference"


@pytest.mark.parametrize("estimate", [paired_ratio, ratio_of_medians])
def test_a_clear_2x_excludes_one(estimate):
    slow = 2 * TIMES * (1 + 0.05 * np.random.default_rng(9).random(9))
    r = estimate(slow, TIMES)
    assert 1.9 < r.value < 2.2 and r.low > 1.5
    assert r.low <= r.value <= r.high
    assert r.verdict() == "faster" and r.verdict("vpipe faster", "torch faster") == "vpipe faster"
    assert estimate(TIMES, slow).verdict() == "slower"


@pytest.mark.parametrize("estimate", [paired_ratio, ratio_of_medians])
def test_the_interval_is_reproducible(estimate):
    other = TIMES[::-1] * 1.02
    assert estimate(TIMES, other) == estimate(TIMES.copy(), other.copy())


def test_pairwise_ratios_cancel_noise_shared_by_a_pair():
    machine = 1 + np.random.default_rng(4).random(9)  # the machine's state, step by step
    r = paired_ratio(1.1 * 0.05 * machine, 0.05 * machine)
    assert r.value == pytest.approx(1.1) and r.low == pytest.approx(1.1)
    assert r.verdict() == "faster"
    # the same steps unpaired: the shared noise is not cancelled
    assert ratio_of_medians(1.1 * 0.05 * machine, 0.05 * machine).verdict() == (
        "no significant difference"
    )


def test_too_few_samples_give_no_interval_or_verdict():
    few = TIMES[: MIN_SAMPLES - 1]
    for r in (paired_ratio(2 * few, few), ratio_of_medians(2 * few, few)):
        assert r.value == pytest.approx(2.0)
        assert not r.has_interval and r.interval_text() == ""
        assert r.verdict() == f"too few steps (< {MIN_SAMPLES})"
    assert paired_ratio(2 * TIMES[:MIN_SAMPLES], TIMES[:MIN_SAMPLES]).verdict() == "faster"


def test_outliers_are_steps_over_three_times_their_median():
    t = np.array([1.0, 1.1, 0.9, 1.0, 3.0, 3.5, 1.0])
    assert OUTLIER_FACTOR == 3.0
    assert outliers(t).tolist() == [False, False, False, False, False, True, False]
    assert outliers([]).size == 0


def test_outliers_are_counted_and_excluded():
    base = TIMES.copy()
    hiccup = TIMES.copy()
    hiccup[4] *= 20  # one step of the run stalls
    paired = paired_ratio(base, hiccup)
    assert paired.outliers == 1 and paired.n == 8  # its pair is left out
    assert paired.value == pytest.approx(1.0) and paired.verdict() == "no significant difference"
    two = ratio_of_medians(hiccup, base)
    assert two.outliers == 1 and two.n == 8
    assert two.value == pytest.approx(np.median(np.delete(hiccup, 4)) / np.median(base))


def test_paired_samples_must_align():
    with pytest.raises(ValueError, match="differ in length"):
        paired_ratio(TIMES, TIMES[:-1])


@settings(max_examples=30, deadline=None)
@given(
    times=st.lists(st.floats(0.01, 1.0), min_size=MIN_SAMPLES, max_size=12),
    scale=st.floats(0.25, 4.0),
)
def test_scaling_one_side_scales_ratio_and_interval(times, scale):
    t = np.array(times)
    base = paired_ratio(t, t[::-1])
    scaled = paired_ratio(scale * t, t[::-1])
    np.testing.assert_allclose(
        [scaled.value, scaled.low, scaled.high],
        [scale * base.value, scale * base.low, scale * base.high],
        rtol=1e-9,
        equal_nan=True,  # outliers may leave too few pairs for an interval
    )
