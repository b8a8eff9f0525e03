"""Cross-run statistics on synthetic steps with known answers: normalisation cancels a host
that is uniformly slower, the hierarchical interval carries run-to-run spread, verdicts and
the rounds that would settle an inconclusive one."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vpipe.report.crossrun import (
    MIN_BLOCKS,
    MIN_EFFECT,
    Block,
    Z,
    between_block_sd,
    blocks_to_settle,
    cross_ratio,
    family_confidence,
    launch_spread,
    noise_threshold,
    paired_rounds_to_settle,
    rounds_to_settle,
    run_drift,
    t_quantile,
    verdict,
)


def _block(rng, step=0.1, ref=0.01, slow=1.0, noise=0.02, n=12, extra=0.0):
    """n steps and references of a host ``slow`` times slower than nominal, with an extra
    (code) delay of ``extra`` seconds per step that the reference does not see."""
    jitter = 1 + noise * rng.standard_normal(n)
    refs = ref * slow * (1 + noise * rng.standard_normal(n))
    return Block.of(step * slow * jitter + extra, refs)


def test_normalisation_cancels_a_uniformly_slower_host():
    rng = np.random.default_rng(0)
    quiet = [_block(rng) for _ in range(4)]
    busy = [_block(rng, slow=1.6) for _ in range(4)]
    raw = cross_ratio(quiet, busy, normalise=False, launch_sd=0.0)
    norm = cross_ratio(quiet, busy, normalise=True, launch_sd=0.0)
    assert raw.value == pytest.approx(1 / 1.6, rel=0.03) and raw.high < 0.7
    assert norm.normalised and norm.value == pytest.approx(1.0, abs=0.03)
    assert norm.low < 1 < norm.high
    assert verdict(norm, noise_threshold(0.02)) == "within noise"
    assert verdict(raw, noise_threshold(0.02)) == "slower"


def test_a_code_slowdown_survives_normalisation():
    rng = np.random.default_rng(1)
    base = [_block(rng) for _ in range(MIN_BLOCKS)]
    slower = [_block(rng, extra=0.015) for _ in range(MIN_BLOCKS)]  # 15% on a 0.1 s step
    r = cross_ratio(base, slower, normalise=True, launch_sd=0.0)
    assert r.hierarchical and r.value == pytest.approx(1 / 1.15, rel=0.03)
    assert verdict(r, noise_threshold(0.0)) == "slower"


def test_hierarchical_interval_carries_between_block_spread():
    rng = np.random.default_rng(2)

    # each launch runs at its own speed (sd 10% between blocks), steps tightly around it
    def side():
        return [_block(rng, slow=math.exp(0.1 * rng.standard_normal()), noise=0.005,
                       ref=0.01 / math.exp(0)) for _ in range(MIN_BLOCKS)]  # fmt: skip

    a, b = side(), side()
    r = cross_ratio(a, b, normalise=False, launch_sd=0.0)
    within_only = cross_ratio(a[:1], b[:1], normalise=False, launch_sd=0.0)
    # the between-block sd of 0.1 gives a log-ratio sd of about 0.1*sqrt(2/8) = 0.05
    half = (math.log(r.high) - math.log(r.low)) / 2
    assert 0.05 < half < 0.25 and r.hierarchical
    assert (math.log(within_only.high) - math.log(within_only.low)) / 2 < 0.02
    est = between_block_sd([a, b], normalise=False)
    assert est == pytest.approx(0.1, rel=0.45)


def test_single_blocks_are_widened_by_the_run_to_run_spread():
    rng = np.random.default_rng(3)
    a, b = [_block(rng)], [_block(rng)]
    narrow = cross_ratio(a, b, normalise=True, launch_sd=0.0)
    wide = cross_ratio(a, b, normalise=True, launch_sd=0.05)
    assert not wide.hierarchical and wide.between == pytest.approx(1.96 * 0.05 * math.sqrt(2), 1e-3)
    assert wide.low < narrow.low and wide.high > narrow.high
    half = (math.log(wide.high) - math.log(wide.low)) / 2
    assert half == pytest.approx(math.hypot(wide.within, wide.between), rel=1e-9)


def test_few_launches_widen_by_students_t():
    """A spread estimated from few launches is uncertain itself: the interval uses Student's t
    for its degrees of freedom, falling to the normal quantile as they grow."""
    assert t_quantile(None) == pytest.approx(Z) and t_quantile(4) == pytest.approx(2.776, abs=1e-3)
    assert t_quantile(1) == pytest.approx(12.706, abs=1e-3)
    assert t_quantile(2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile(10) == pytest.approx(2.228, abs=1e-3)
    assert t_quantile(10, 0.99) == pytest.approx(3.169, abs=2e-3)  # tables' t(0.995, 10)
    assert t_quantile(8, 0.995) == pytest.approx(3.833, abs=2e-3)
    assert t_quantile(10) > t_quantile(20) > t_quantile(1000) > Z
    with pytest.raises(ValueError):
        t_quantile(0)
    with pytest.raises(ValueError):
        t_quantile(4, 1.0)
    rng = np.random.default_rng(4)
    a, b = [_block(rng), _block(rng)], [_block(rng), _block(rng)]
    known = cross_ratio(a, b, normalise=True, launch_sd=0.05)
    guessed = cross_ratio(a, b, normalise=True, launch_sd=0.05, launch_dof=4)
    assert guessed.between == pytest.approx(known.between * 2.776 / Z, rel=1e-3)
    assert guessed.low < known.low and guessed.high > known.high
    sd, dof = launch_spread([a, b], normalise=True)
    assert dof == 2 and 0 <= sd <= between_block_sd([a, b], normalise=True)


def test_launch_spread_separates_launch_effects_from_sampling_noise():
    """Blocks of few noisy steps spread widely with no launch effect at all; blocks of many
    precise steps spread only by their launch effect. The launch sd counts only the latter,
    while the blocks' total spread counts both."""
    rng = np.random.default_rng(5)
    noisy = [[_block(rng, noise=0.15, n=9) for _ in range(3)] for _ in range(40)]
    total = between_block_sd(noisy, normalise=False)
    launch, dof = launch_spread(noisy, normalise=False)
    assert dof == 80 and total > 0.05 and launch < 0.4 * total

    def launched(sd):
        return _block(rng, slow=math.exp(sd * rng.standard_normal()), noise=0.005, n=30)

    precise = [[launched(0.05) for _ in range(3)] for _ in range(40)]
    launch, _ = launch_spread(precise, normalise=False)
    assert launch == pytest.approx(0.05, rel=0.2)


def test_run_drift_is_what_back_to_back_blocks_cannot_show():
    """40 runs of 5 blocks, 2 configs: each run's host is off by its own factor (sd 4%), its
    blocks by 1% more. The drift estimate finds the 4%; without a run effect it finds ~0."""
    rng = np.random.default_rng(8)

    def runs(run_sd):
        out = []
        for _ in range(40):
            host = math.exp(run_sd * rng.standard_normal())
            out.append([[_block(rng, slow=host * math.exp(0.01 * rng.standard_normal()),
                                noise=0.005, n=10) for _ in range(5)] for _ in range(2)])  # fmt: skip
        return out

    assert run_drift(runs(0.04), normalise=False) == pytest.approx(0.04, rel=0.25)
    assert run_drift(runs(0.0), normalise=False) < 0.01
    assert run_drift(runs(0.04)[:1], normalise=False) is None


def test_precise_blocks_resolve_a_15_percent_delay_with_three_launches():
    """With 30 steps per block (2% noise) and launches 3% apart, three blocks per side
    resolve a 15% delay and call an identical run within noise."""
    rng = np.random.default_rng(6)

    def side(extra=0.0):
        return [_block(rng, slow=math.exp(0.03 * rng.standard_normal()), n=30, extra=extra)
                for _ in range(3)]  # fmt: skip

    base = side()
    slow = cross_ratio(base, side(extra=0.015), normalise=True, launch_sd=0.03, launch_dof=8)
    same = cross_ratio(base, side(), normalise=True, launch_sd=0.03, launch_dof=8)
    assert verdict(slow, noise_threshold(slow.noise_sd)) == "slower"
    assert verdict(same, noise_threshold(same.noise_sd)) == "within noise"
    assert 0.03 < same.noise_sd < 0.05


def test_many_configs_keep_the_a_a_false_alarm_rate_at_5_percent():
    """60 A/A comparisons of 10 configs (launches 3% apart, as assumed): with 95% intervals
    per config about a third of the comparisons call some config faster or slower; with the
    family's confidence (Bonferroni) about 5% do."""
    rng = np.random.default_rng(7)

    def launch():
        return [_block(rng, slow=math.exp(0.03 * rng.standard_normal()), noise=0.01, n=20)]

    def alarmed(configs):
        words = []
        for _ in range(10):
            r = cross_ratio(launch(), launch(), normalise=False, launch_sd=0.03,
                            confidence=family_confidence(configs))  # fmt: skip
            words.append(verdict(r, noise_threshold(r.noise_sd)))
        return any(w in ("faster", "slower") for w in words)

    assert family_confidence(10) == pytest.approx(0.995) and family_confidence(1) == 0.95
    per_config = sum(alarmed(1) for _ in range(60))
    family = sum(alarmed(10) for _ in range(60))
    assert per_config >= 12 and family <= 7, (per_config, family)


def test_verdict_rules_and_host_differed():
    def ratio(lo, hi, value=None):
        v = value if value is not None else math.sqrt(lo * hi)
        lw, hw = math.log(lo), math.log(hi)
        return cross_ratio_stub(v, lo, hi, (hw - lw) / 2)

    t = 0.05
    assert verdict(ratio(1.10, 1.30), t) == "faster"
    assert verdict(ratio(0.70, 0.90), t) == "slower"
    assert verdict(ratio(0.98, 1.03), t) == "within noise"
    assert verdict(ratio(1.01, 1.05), t) == "within noise"  # real, but inside the noise band
    # a wide noise band does not swallow a difference whose interval excludes 1
    assert verdict(ratio(1.08, 1.22), 0.21) == "faster"
    assert verdict(ratio(0.95, 1.25), t) == "inconclusive"  # holds 1 and a 20% effect
    assert verdict(ratio(0.70, 0.90), t, ["other processes' CPU 0.1 vs 1.0 cores"]) == (
        "host differed"
    )
    assert verdict(ratio(0.95, 1.25), t, ["CPU steal"]) == "host differed"
    # a host that differed leaves no claim, not even "within noise"
    assert verdict(ratio(0.98, 1.03), t, ["CPU steal"]) == "host differed"
    assert noise_threshold(0.0) == MIN_EFFECT == noise_threshold(float("nan"))
    assert noise_threshold(0.04) == pytest.approx(1.96 * 0.04 * math.sqrt(2), rel=1e-3)


def cross_ratio_stub(value, low, high, within, between=0.0):
    from vpipe.report.crossrun import CrossRatio

    return CrossRatio(value, low, high, (1, 1), (9, 9), True, 0, within, between, False)


def test_rounds_to_settle_scales_with_the_variance():
    # estimate 6% (log 0.06), band 0.05, half-width 0.09: holds 1 and a 15% effect;
    # a half-width of 0.06 would exclude 1
    r = cross_ratio_stub(math.exp(0.06), math.exp(-0.03), math.exp(0.15), 0.09)
    assert verdict(r, 0.05) == "inconclusive"
    target = math.log(r.value)
    assert rounds_to_settle(r, 0.05, 3) == math.ceil(3 * 0.09**2 / target**2)
    assert 6 <= rounds_to_settle(r, 0.05, 3) <= 8
    # the run-to-run part alone is wider than what would decide: no number of rounds does
    stuck = cross_ratio_stub(1.03, 0.9, 1.18, 0.02, between=0.08)
    assert rounds_to_settle(stuck, 0.03, 3) is None
    # more blocks shrink both parts: estimate 3% (log 0.0296), band 0.06, so the interval must
    # fit inside +-0.06, i.e. a half-width of 0.0304 from hypot(0.02, 0.08) = 0.0825 now
    need = math.ceil((math.hypot(0.02, 0.08) / (0.06 - math.log(1.03))) ** 2)
    assert blocks_to_settle(stuck, 0.03) == need == 8
    assert paired_rounds_to_settle(1.05, 0.99, 1.11, 3) == math.ceil(
        3 * ((math.log(1.11) - math.log(0.99)) / 2 / math.log(1.05)) ** 2
    )
    assert paired_rounds_to_settle(1.0, 0.9, 1.1, 3) is None


def test_old_sweeps_without_references_compare_raw():
    rng = np.random.default_rng(4)
    a = [Block.of(0.1 + 0.001 * rng.random(9))]
    b = [_block(rng, n=9)]
    r = cross_ratio(a, b, normalise=True, launch_sd=0.04)
    assert not r.normalised and r.has_interval
    assert between_block_sd([a, b], normalise=False) is None  # one block each
    with pytest.raises(ValueError, match="3 steps but 2 reference"):
        Block.of([1, 2, 3], [1, 2])
