"""vpipe ab: the launch order and its pairs, the paired verdicts, the versions' environments, a
side that fails, and Ctrl-C. The session logic runs against stand-in sides (a tiny program
speaking the paced protocol, as ``python -m vpipe`` in a directory of its own), so that order,
failure and interruption are exact and fast; one test runs two real sides end to end."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from vpipe.report.ab_report import (
    OVERALL,
    ab_headline,
    ab_report,
    session_pairs,
    session_table,
    settled,
)
from vpipe.report.looks import ALPHA, FINAL_SHARE, levels, look_alpha, report_alpha
from vpipe.report.pairs import (
    FIT_PAIRS,
    GATED_LOADED_LAUNCH_SD,
    LOADED_LAUNCH_SD,
    PAIR_LAUNCH_SD,
    PRIOR_WEIGHT,
    RAW,
    Figure,
    Pair,
    Spread,
    differences,
    fit_figure,
    overall_ratio,
    pair_verdict,
    paired_ratio,
    session_order,
    session_spread,
)
from vpipe.sweep.ab import pairs_that_fit, process_start, run_session
from vpipe.sweep.envs import EnvError, Version, prepare

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [["1f1b", 4, "vpipe"], ["zbv", 4, "vpipe"]]
READY = {"configs": CONFIGS, "reference": {"rows": 32}, "device": "cpu", "ready": True}


def test_launches_alternate_a_b_b_a():
    assert "".join(session_order(10)) == "ABBAABBAAB"


def _message(rng, scale: float, n: int = 9, other: float = 0.0, sd: float = 0.03) -> dict:
    steps = [list(0.07 * scale * np.exp(sd * rng.standard_normal(n))) for _ in CONFIGS]
    refs = [list(0.006 * np.exp(0.01 * rng.standard_normal(n))) for _ in CONFIGS]
    host = [{"other_cores": other, "free_cores": 2 - other, "steal": 0.0, "mhz": 2600.0}] * 3
    return {"block": 0, "wall_s": 1.0, "steps": steps, "refs": refs, "host": host}


def _session(
    pairs: int, b_scale: float, seed: int = 0, hog_from: int | None = None, sd: float = 0.03
) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i, side in enumerate(session_order(2 * pairs)):
        hogged = hog_from is not None and i >= hog_from
        scale = (b_scale if side == "B" else 1.0) * (1.6 if hogged else 1.0)
        out.append((side, _message(rng, scale, other=1.0 if hogged else 0.0, sd=sd)))
    return out


def test_pairs_are_adjacent_launches_and_a_host_change_leaves_one_out():
    launches = _session(4, 1.0, hog_from=5)  # the hog starts in pair 3's second launch
    pairs = session_pairs({"A": READY, "B": READY}, launches)
    assert list(pairs) == [("1f1b", 4, "vpipe"), ("zbv", 4, "vpipe")]
    left_out = [i for i, p in enumerate(pairs[("zbv", 4, "vpipe")]) if p.host_differences]
    assert left_out == [2]
    assert "other processes' CPU" in pairs[("zbv", 4, "vpipe")][2].host_differences[0]


def _table(launches, alpha: float = ALPHA * FINAL_SHARE, delay: str = ""):
    """The session's table at a look spending ``alpha`` (default: the last look of a session
    that looked before it)."""
    return session_table(
        {"A": READY, "B": READY}, launches, alpha=alpha, labels={"A": "a", "B": "b"},
        delay_b=delay,
    )  # fmt: skip


def test_the_same_code_is_within_noise_and_a_10_percent_slowdown_is_slower():
    same, _, _ = _table(_session(8, 1.0))
    assert list(same["verdict"]) == ["within noise"] * 3 and settled(same)
    assert list(same["schedule"]) == ["1f1b", "zbv", OVERALL]
    slow, spread, why = _table(_session(8, 1.1), delay="7 ms")
    assert list(slow["verdict"]) == ["slower"] * 3 and settled(slow)
    for ratio in slow["speedup"].astype(float):
        assert 0.87 < ratio < 0.95  # A/B: B is 10% slower
    assert spread.dof is None and "fitted to 16 pairs" in why  # the floor held, weight fitted
    assert set(slow["injected delay (B)"]) == {"7 ms"}


def test_over_all_configs_a_slowdown_shows_before_it_does_in_each():
    # B 5% slower, steps spreading 6%, 4 pairs, 30 sessions: the mean over the two configs
    # (half the error rate) calls it far more often than both configs do (a quarter each)
    tables = [_table(_session(4, 1.05, seed=seed, sd=0.06))[0] for seed in range(30)]
    overall = sum(t["verdict"].iloc[2] == "slower" for t in tables)
    both = sum((t["verdict"].iloc[:2] == "slower").all() for t in tables)
    assert overall >= 12 and both <= overall - 10  # measured: 15 of 30 against 0
    for t in tables:  # the configs' noise partly cancels in their mean
        width = [float(hi) / float(lo) for lo, hi in (ci.split("-") for ci in t["95% CI"])]
        assert width[2] < min(width[:2])
    table = tables[0]  # called slower over all, neither config yet
    configs, overall = table.iloc[:2], table.iloc[2]
    assert overall["verdict"] == "slower" and set(configs["verdict"]) == {"inconclusive"}
    assert settled(table)  # an answer over all configs ends the session
    line = ab_headline(table, "a")
    assert line.startswith("winner: a, faster than b over all 2 configs: ")
    assert "per config: 2 inconclusive" in line
    # within noise over all does not end it alone: the configs could have moved apart
    mixed = table.assign(verdict=["slower", "inconclusive", "within noise"])
    assert not settled(mixed)


def test_one_config_has_no_row_over_all_and_takes_the_whole_error_rate():
    one = {**READY, "configs": CONFIGS[:1]}
    launches = [(k, {**m, "steps": m["steps"][:1], "refs": m["refs"][:1]}) for k, m in _session(4, 1.0)]
    table, _, _ = session_table({"A": one, "B": one}, launches, alpha=0.02, labels={"A": "a", "B": "b"})
    assert list(table["schedule"]) == ["1f1b"]
    assert levels(0.02, 1) == (0.98, 0.98) and levels(0.02, 2) == (0.99, 0.995)


def test_inconclusive_says_how_many_pairs_would_settle_it():
    first_look = ALPHA * (1 - FINAL_SHARE) / 6  # after 2 of 8 pairs
    table, _, _ = _table(_session(2, 1.05), first_look)
    assert set(table["verdict"]) == {"inconclusive"} and not settled(table)
    for text in table["to settle"]:
        n = int(text.split("~")[1].split()[0])
        assert n > 2 and f"--pairs {n}" in text


def test_a_hogged_pair_counts_less_than_a_quiet_one():
    rng = np.random.default_rng(3)
    from vpipe.report.crossrun import Block

    def block(scale, sd):
        return Block.of(0.07 * scale * np.exp(sd * rng.standard_normal(12)))

    quiet = [Pair(block(1.0, 0.02), block(1.1, 0.02)) for _ in range(4)]
    noisy = [Pair(block(1.0, 0.4), block(0.8, 0.4))]  # a pair under a hog: far noisier
    spread = session_spread([])
    r = paired_ratio(quiet + noisy, RAW, spread, 0.95)
    alone = paired_ratio(quiet, RAW, spread, 0.95)
    assert abs(math.log(r.value) - math.log(alone.value)) < 0.03


def _drifting(pairs: int, follow: float, seed: int, b_scale: float = 1.0) -> list:
    """Launches on a host whose speed moves from launch to launch (log sd 0.1): the references
    follow it fully, each with 25% noise per timing; the steps follow ``follow`` of it, each
    with 10% noise."""
    rng = np.random.default_rng(seed)
    out = []
    for side in session_order(2 * pairs):
        h = 0.1 * rng.standard_normal()
        scale = 0.07 * (b_scale if side == "B" else 1.0)
        steps = [list(scale * np.exp(follow * h + 0.1 * rng.standard_normal(9))) for _ in CONFIGS]
        refs = [list(0.006 * np.exp(h + 0.25 * rng.standard_normal(9))) for _ in CONFIGS]
        host = [{"other_cores": 0.0, "free_cores": 2.0, "steal": 0.0, "mhz": 2600.0}] * 3
        out.append((side, {"block": 0, "wall_s": 1.0, "steps": steps, "refs": refs, "host": host}))
    return out


def _figure(launches, same_reference: bool = True):
    pairs = session_pairs({"A": READY, "B": READY}, launches)
    return fit_figure(same_reference, list(pairs.values())), pairs


def test_the_reference_weight_is_what_the_steps_follow_of_the_host():
    # a pair's reference difference: host 2 x 0.01, noise 2 x (1.25 x 0.25)^2 / 9; the steps
    # follow half the host: the least-spread weight is 0.5 x 0.02 / (0.02 + 0.0217) = 0.24
    figure, pairs = _figure(_drifting(40, 0.5, seed=1))
    assert figure.fitted and abs(figure.weight - 0.24) < 3 * math.sqrt(figure.weight_var)
    assert figure.weight_var < 0.01 and "fitted to 80 pairs" in figure.why
    spread = {w: sum(float(np.var(differences(ps, w)[0])) for ps in pairs.values())
              for w in (0.0, figure.weight, 1.0)}  # fmt: skip
    assert spread[figure.weight] < min(spread[0.0], spread[1.0])
    # steps that follow the host fully and references without noise of their own: normalised
    assert _figure(_drifting(12, 1.0, seed=2))[0].weight > 0.3
    # the fit is bounded: steps that move against the references weigh them 0, not below
    assert _figure(_drifting(12, -1.0, seed=3))[0].weight == 0.0


def test_the_reference_weight_before_the_fit_and_without_a_shared_reference():
    early = _drifting(FIT_PAIRS - 1, 0.5, seed=4)
    assert _figure(early)[0] == _figure(early)[0] and not _figure(early)[0].fitted
    assert _figure(early)[0].weight == PRIOR_WEIGHT
    different = _figure(_drifting(8, 0.5, seed=4), same_reference=False)[0]
    assert different.weight == 0.0 and "different host-speed references" in different.why
    none = [(k, {**m, "refs": None}) for k, m in _drifting(8, 0.5, seed=4)]
    assert _figure(none)[0].weight == 0.0


def test_a_fitted_weight_finds_slowdowns_on_hosts_where_neither_fixed_figure_does():
    # 8 pairs at the last look's error rate, 20 sessions of B 10% slower on each drifting host
    # (steps following half the host's moves, then all of them) and 20 A/A; the same
    # sessions' verdicts over all configs with each figure
    def overall(launches, figure: Figure | None) -> str:
        configs = list(session_pairs({"A": READY, "B": READY}, launches).values())
        figure = figure or fit_figure(True, configs)
        spread = session_spread((differences(ps, figure.weight) for ps in configs), figure.fitted)
        level = levels(ALPHA * FINAL_SHARE, len(configs))[0]
        return pair_verdict(overall_ratio(configs, figure, spread, level))

    same = [overall(_drifting(8, 0.5, seed), None) for seed in range(20)]
    assert sum(v in ("faster", "slower") for v in same) <= 1  # measured 1
    figures = {"fitted": None, "raw": RAW, "normalised": Figure(1.0)}
    found = {name: 0 for name in figures}
    for follow in (0.5, 1.0):
        slow = [_drifting(8, follow, seed, b_scale=1.1) for seed in range(20)]
        here = {k: sum(overall(x, f) == "slower" for x in slow) for k, f in figures.items()}
        assert here["fitted"] >= max(here["raw"], here["normalised"]) - 1
        found = {k: found[k] + here[k] for k in found}
    # measured: 14 and 7 fitted, raw 15 and 5, normalised 4 and 4
    assert found["fitted"] > max(found["raw"], found["normalised"])


def test_a_pair_under_a_hog_carries_the_launch_spread_measured_under_one():
    launches = _session(4, 1.0, hog_from=4)  # pairs 1-2 quiet, 3-4 entirely under the hog
    pairs = session_pairs({"A": READY, "B": READY}, launches)[("1f1b", 4, "vpipe")]
    assert [p.loaded for p in pairs] == [False, False, True, True]
    assert not any(p.host_differences for p in pairs)
    rng = np.random.default_rng(5)
    from vpipe.report.crossrun import Block

    def block(scale):
        return Block.of(0.07 * scale * np.exp(0.03 * rng.standard_normal(9)))

    quiet = [Pair(block(1.0), block(1.05)) for _ in range(5)]
    hogged = [Pair(p.a, p.b, loaded=True) for p in quiet]
    spread = session_spread([])
    narrow, wide = (paired_ratio(ps, RAW, spread, 0.95) for ps in (quiet, hogged))
    assert narrow.value == pytest.approx(wide.value, rel=0.01)  # the same pairs
    # half-width: 1.96 x sqrt((v + 2 x 0.045^2) / 5) against the quiet floor's 2 x 0.02^2
    assert math.log(wide.high / wide.value) > 1.8 * math.log(narrow.high / narrow.value)
    assert math.log(wide.high / wide.value) == pytest.approx(
        1.96 * math.sqrt((2 * LOADED_LAUNCH_SD**2 + 2 * 0.03**2 * 1.57 / 9) / 5), rel=0.35
    )



def _half_width(r) -> float:
    return math.log(r.high / r.value)


def _expected_half(pairs, tau2: float, q: float) -> float:
    """q x the sd of the inverse-variance weighted mean of the pairs' differences."""
    _, v = differences(pairs, 0.0)
    return q * math.sqrt(1 / float((1 / (v + tau2)).sum()))


def test_a_gated_pair_under_a_hog_takes_the_gated_floor_and_a_floor_is_taken_as_known():
    from vpipe.report.crossrun import Block, t_quantile

    rng = np.random.default_rng(8)

    def block(scale):
        return Block.of(0.07 * scale * np.exp(0.03 * rng.standard_normal(9)))

    base = [Pair(block(1.0), block(1.05), steps_per_round=1) for _ in range(5)]
    quiet, gated = base, [Pair(p.a, p.b, loaded=True, steps_per_round=1) for p in base]
    in_turn = [Pair(p.a, p.b, loaded=True) for p in base]
    floor = session_spread([])  # the quiet floor, known
    widths = [_half_width(paired_ratio(ps, RAW, floor, 0.95)) for ps in (quiet, gated, in_turn)]
    assert widths[0] < widths[1] < widths[2]
    assert widths[1] == pytest.approx(
        _expected_half(gated, 2 * GATED_LOADED_LAUNCH_SD**2, 1.959964), rel=1e-6
    )
    # a spread measured over 4 dof, above the quiet floor but under the gated loaded one: the
    # quiet pairs take it with Student's t, the loaded ones the floor with the normal quantile
    measured = Spread(1.2 * 2 * PAIR_LAUNCH_SD**2, 4, "measured")
    assert 2 * PAIR_LAUNCH_SD**2 < measured.tau2 < 2 * GATED_LOADED_LAUNCH_SD**2
    assert _half_width(paired_ratio(quiet, RAW, measured, 0.95)) == pytest.approx(
        _expected_half(quiet, measured.tau2, t_quantile(4, 0.95)), rel=1e-6
    )
    assert _half_width(paired_ratio(gated, RAW, measured, 0.95)) == pytest.approx(
        _expected_half(gated, 2 * GATED_LOADED_LAUNCH_SD**2, 1.959964), rel=1e-6
    )
    # one quiet pair among them uses the measured spread: Student's t again
    mixed = [*quiet[:1], *gated[1:]]
    _, v = differences(mixed, 0.0)
    tau2 = np.array([measured.tau2] + [2 * GATED_LOADED_LAUNCH_SD**2] * 4)
    expected = t_quantile(4, 0.95) * math.sqrt(1 / float((1 / (v + tau2)).sum()))
    assert _half_width(paired_ratio(mixed, RAW, measured, 0.95)) == pytest.approx(expected, rel=1e-6)


def _wandering(pairs: int, gated: bool, seed: int, b_scale: float = 1.0) -> list:
    """Launches on a host whose speed wanders over seconds (log sd 0.06 per launch, drifting
    over its rounds), each step with 3% noise of its own. Gated: a pair's two launches ran
    at once, their rounds alternating, so A's round j and B's saw nearly the same host (1%
    apart); not gated: each launch saw its own stretch of the host."""
    rng = np.random.default_rng(seed)
    out = []
    host = [{"other_cores": 0.0, "free_cores": 2.0, "steal": 0.0, "mhz": 2600.0}] * 3
    wander = None
    for i, side in enumerate(session_order(2 * pairs)):
        if not gated or i % 2 == 0:
            wander = 0.06 * rng.standard_normal() + np.cumsum(0.02 * rng.standard_normal(9))
        seen = wander + (0.01 * rng.standard_normal(9) if gated else 0.0)
        scale = 0.07 * (b_scale if side == "B" else 1.0)
        steps = [list(scale * np.exp(seen + 0.03 * rng.standard_normal(9))) for _ in CONFIGS]
        refs = [list(0.006 * np.exp(0.25 * rng.standard_normal(9))) for _ in CONFIGS]
        message = {"block": 0, "wall_s": 1.0, "steps": steps, "refs": refs, "host": host}
        out.append((side, {**message, "gated": {"rounds": 9, "steps": 1}} if gated else message))
    return out


def test_gated_pairs_compare_round_by_round_and_answer_where_launches_in_turn_cannot():
    pairs = session_pairs({"A": READY, "B": READY}, _wandering(4, True, 0))
    assert {p.steps_per_round for ps in pairs.values() for p in ps} == {1}
    # a hog in one launch's busiest round only: launches in turn are left out, gated ones kept
    launches = _wandering(4, True, 0)
    launches[2][1]["host"] = [{**launches[2][1]["host"][0], "other_cores": 1.0}]
    hogged = session_pairs({"A": READY, "B": READY}, launches)[("zbv", 4, "vpipe")][1]
    assert hogged.loaded and not hogged.host_differences
    launches = [(k, {x: y for x, y in m.items() if x != "gated"}) for k, m in launches]
    in_turn = session_pairs({"A": READY, "B": READY}, launches)[("zbv", 4, "vpipe")][1]
    assert in_turn.loaded and in_turn.host_differences
    one = pairs[("1f1b", 4, "vpipe")][0]
    d, v = differences([one], 0.0)
    rounds = np.log(one.a.steps) - np.log(one.b.steps)
    assert d[0] == pytest.approx(np.median(rounds))  # the median of its rounds' log(A/B)
    # 20 sessions of 8 pairs each way, B 10% slower, and 20 A/A, over all configs
    def overall(launches) -> str:
        return _table(launches)[0].set_index("schedule").loc[OVERALL, "verdict"]

    for gated, least, most in ((True, 19, 20), (False, 0, 12)):
        slow = [overall(_wandering(8, gated, seed, 1.1)) for seed in range(20)]
        assert least <= slow.count("slower") <= most  # measured: gated 20, in turn 9
    same = [overall(_wandering(8, True, seed)) for seed in range(20)]
    assert sum(v in ("faster", "slower") for v in same) <= 1  # measured 0
    assert same.count("within noise") >= 18  # measured 20


def test_a_gated_pairs_sampling_variance_is_pooled_over_its_rounds_apart_for_loaded_pairs():
    from vpipe.report.crossrun import Block

    rng = np.random.default_rng(2)

    def pair(sd: float, loaded: bool) -> Pair:
        a, b = (Block.of(0.07 * np.exp(sd * rng.standard_normal(9))) for _ in range(2))
        return Pair(a, b, loaded=loaded, steps_per_round=1)

    quiet = [pair(0.03, False) for _ in range(6)]
    hogged = [pair(0.15, True) for _ in range(6)]
    d, v = differences(quiet + hogged, 0.0)
    assert len(set(v[:6])) == 1 and len(set(v[6:])) == 1  # one pool each
    # a round's difference has sd 0.03 x sqrt 2 (quiet), 0.15 x sqrt 2 (hogged); the median
    # of 9: x 1.2533 / 3
    assert math.sqrt(v[0]) == pytest.approx(0.03 * math.sqrt(2) * 1.2533 / 3, rel=0.35)
    assert math.sqrt(v[6]) == pytest.approx(0.15 * math.sqrt(2) * 1.2533 / 3, rel=0.35)
    assert np.std(d[:6]) < 0.05


def _spend(expected_last: list[int]) -> list[float]:
    """What the looks at pairs 2, 3, ... spend when, at each, the last pair is expected to be
    ``expected_last[i]`` (a look is the last when that is its own pair)."""
    spent: list[float] = []
    for i, last in enumerate(expected_last):
        n = 2 + i
        spent.append(look_alpha(sum(spent), last - n))
        if last == n:
            break
    assert all(x >= 0 for x in spent) and sum(spent) <= ALPHA + 1e-12
    return spent


def test_the_looks_spend_5_percent_half_of_it_at_the_last():
    spent = _spend([8] * 7)  # --pairs 8, no time limit in sight: looks at pairs 2..8
    assert spent[:-1] == pytest.approx([ALPHA * (1 - FINAL_SHARE) / 6] * 6)
    assert spent[-1] == pytest.approx(ALPHA * FINAL_SHARE) and sum(spent) == pytest.approx(ALPHA)
    # a time limit draws nearer: the last look comes sooner, the shares grow, never past 5%
    sooner = _spend([8, 8, 6, 5, 5])
    assert len(sooner) == 4 and sum(sooner) == pytest.approx(ALPHA)
    assert sooner[2] > sooner[1] and sooner[-1] >= ALPHA * FINAL_SHARE
    assert _spend([2]) == [ALPHA]  # one look: all of it
    # the limit seemed to be one pair away, then the pairs got faster: that look took the
    # rest of the early share, so the looks before the last get nothing (vpipe ab skips them)
    later = _spend([3, 5, 5, 5])
    assert later[1:3] == [0.0, 0.0] and later[-1] == pytest.approx(ALPHA * FINAL_SHARE)


def test_the_report_spends_what_the_session_left():
    interim = {"alpha": 0.004, "last": False, "settled": False}
    assert report_alpha([]) == ALPHA  # no look yet
    assert report_alpha([interim, {"alpha": 0.03, "last": True, "settled": False}]) == 0.03
    assert report_alpha([{**interim, "settled": True}]) == 0.004  # settled there: its verdicts
    assert report_alpha([interim, interim]) == pytest.approx(ALPHA - 0.008)  # interrupted


def test_a_pair_starts_only_if_it_ends_in_time():
    assert pairs_that_fit(60.0, []) == 0
    assert pairs_that_fit(60.0, [5.0, 5.0]) == 11  # 5 s kept for writing the stores and report
    assert pairs_that_fit(59.9, [5.0, 5.0]) == 10
    assert pairs_that_fit(60.0, [5.0, 9.0]) == 6  # the slower of the last two
    assert pairs_that_fit(2.0, [5.0]) == 0
    assert pairs_that_fit(60.0, [5.0, 5.0], loaded=True) == 10  # 10 s kept under a hog


def test_a_stricter_look_has_a_wider_interval():
    launches = _session(3, 1.0)
    wide = _table(launches, 0.002)[0]
    narrow = _table(launches, 0.05)[0]
    for w, n in zip(wide["95% CI"], narrow["95% CI"], strict=True):
        lw, hw = map(float, w.split("-"))
        ln, hn = map(float, n.split("-"))
        assert lw < ln and hw > hn


def test_the_report_has_a_verdict_column_and_the_session(tmp_path):
    html, md, table = ab_report(
        {"A": READY, "B": READY}, _session(3, 1.0, hog_from=3), alpha=0.025,
        labels={"A": "HEAD (abc)", "B": "HEAD (abc)"}, stopped="--pairs 3 done",
    )  # fmt: skip
    assert "| verdict |" in md.replace("verdict | to settle", "verdict |")
    assert "Pairs left out" in md and "--pairs 3 done" in md and "<table" in html
    assert list(table["pairs"]) == [2, 2, 2] and list(table["left out"]) == [1, 1, 1]
    assert "over all configs" in md and OVERALL in md


# ---------------------------------------------------------------------------------------------
# Stand-in sides: a program that speaks the paced protocol

FAKE = r'''
import json, os, signal, sys, time
args = sys.argv[1:]
out = args[args.index("--out") + 1]
delay = float(args[args.index("--inject-delay-ms") + 1]) if "--inject-delay-ms" in args else 0
side = os.path.basename(out)
fail_at = int(os.environ.get(f"FAKE_FAIL_{side}", "-1"))
block_s = float(os.environ.get("FAKE_BLOCK_S", "0.02"))
log = open(os.environ["FAKE_LOG"], "a")
def reply(m):
    sys.stdout.write("vpipe-paced " + json.dumps(m) + "\n"); sys.stdout.flush()
interrupted = []  # a Ctrl-C stops the launch in progress; an open launch waiting keeps waiting
signal.signal(signal.SIGINT, lambda *_: interrupted.append(1))
def nap():
    end = time.monotonic() + block_s
    while time.monotonic() < end:
        if interrupted:
            interrupted.clear(); return False
        time.sleep(0.005)
    return True
print("some rank's own output")
gated = {"rounds": 3, "steps": 1} if os.environ.get("FAKE_GATED") else None
reply({"ready": True, "configs": [["1f1b", 4, "vpipe"]], "reference": {"rows": 1}, "device": "cpu",
       **({"gated": gated} if gated else {})})
done = 0
for line in sys.stdin:
    word = line.strip()
    if word == "end":
        break
    log.write(f"{side} {word} {time.monotonic()}\n"); log.flush()
    if gated and word in ("open", "round"):
        if not nap():
            reply({"aborted": done}); continue
        reply({"opened": True} if word == "open" else {"round": 1}); continue
    if done == fail_at:
        reply({"failed": f"rank 1 failed: boom in {side}"}); continue
    if not nap():
        reply({"aborted": done}); continue
    scale = 1 + delay / 70
    reply({"block": done, "wall_s": block_s, "steps": [[0.07 * scale] * 9], "refs": [[0.006] * 9], "host": []})
    done += 1
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "blocks"), "w").write(str(done))
reply({"written": done, "out": out})
'''


@pytest.fixture
def fake_versions(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "vpipe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(FAKE)
    log = tmp_path / "order.log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    python = Path(sys.executable)
    versions = {
        k: Version(k, "HEAD", tmp_path / "fake", python, None, True) for k in ("A", "B")
    }
    return versions, log


def _run(versions, out, **kw):
    kw.setdefault("settled", lambda session, alpha: False)
    return run_session(
        versions, {"A": [], "B": ["--inject-delay-ms", "7"]}, out, pairs=kw.pop("pairs", 3),
        max_minutes=kw.pop("max_minutes", 5), progress=lambda line: None, **kw,
    )  # fmt: skip


def test_a_side_that_exited_is_judged_by_all_it_printed(tmp_path):
    """A side that wrote its blocks and exited before vpipe ab asks, and whose last line the
    reader thread has not read yet: what it wrote, not "nothing written" (a race seen once in
    CI, in the test below)."""
    from vpipe.sweep.ab import SideProcess
    from vpipe.sweep.paced import PREFIX

    reply = PREFIX + json.dumps({"written": 2, "out": "DIR"})
    proc = subprocess.Popen([sys.executable, "-c", f"print({reply!r})"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    proc.wait(timeout=30)
    side = SideProcess(Version("A", "HEAD", tmp_path, Path(sys.executable), None, True), proc,
                       (tmp_path / "A.log").open("w"))  # fmt: skip
    threading.Timer(0.3, side._read).start()  # the reader thread, late
    assert side.finish() == "A: 2 blocks in DIR"


def test_a_session_alternates_and_each_side_writes_its_blocks(tmp_path, fake_versions):
    versions, log = fake_versions
    session, wrote = _run(versions, tmp_path / "out")
    order = [line.split()[0] for line in log.read_text().splitlines()]
    assert "".join(order) == "ABBAAB" and session.stopped == "--pairs 3 done"
    assert {line.split()[1] for line in log.read_text().splitlines()} == {"block"}
    assert (tmp_path / "out" / "A" / "blocks").read_text() == "3"
    assert wrote == [f"A: 3 blocks in {tmp_path / 'out' / 'A'}", f"B: 3 blocks in {tmp_path / 'out' / 'B'}"]
    assert "some rank's own output" in (tmp_path / "out" / "A.log").read_text()
    b = [m for k, m in session.launches if k == "B"]
    assert b[0]["steps"][0][0] == pytest.approx(0.077)  # only B got the delay


def test_the_session_stops_once_settled(tmp_path, fake_versions):
    versions, _ = fake_versions
    seen = []

    def settled(session, alpha):
        seen.append(alpha)
        return len(seen) == 2

    session, _ = _run(versions, tmp_path / "out", pairs=8, settled=settled)
    assert session.stopped == "settled after 3 pairs" and len(session.launches) == 6
    assert seen == pytest.approx([ALPHA * (1 - FINAL_SHARE) / 6] * 2)
    assert [x["settled"] for x in session.looks] == [False, True]


def test_the_session_ends_on_a_last_look_when_another_pair_would_not_fit(
    tmp_path, fake_versions, monkeypatch
):
    versions, log = fake_versions
    monkeypatch.setenv("FAKE_BLOCK_S", "1.0")  # a pair: 2 s; the limit: 6 s, 5 s kept to write
    session, _ = _run(versions, tmp_path / "out", pairs=8, max_minutes=0.1)
    assert session.stopped == "--max-minutes 0.1: another pair would not end in time, after 2 pairs"
    assert session.looks[-1]["last"] and session.looks[-1]["alpha"] == pytest.approx(ALPHA)
    assert log.read_text().count("\n") == 4 and session.wall_s < 8


def test_the_time_limit_counts_from_the_commands_start(tmp_path, fake_versions, monkeypatch):
    versions, _ = fake_versions
    monkeypatch.setenv("FAKE_BLOCK_S", "0.5")  # a pair: 1 s; the limit: 9 s, 5 s kept to write
    # 3 s went to starting the command and preparing the versions: after 2 pairs (5.3 s) no
    # further pair fits, where from the session's own start another would have
    started = time.monotonic() - 3.0
    session, _ = _run(versions, tmp_path / "out", pairs=8, max_minutes=0.15, started=started)
    assert session.stopped.endswith("after 2 pairs") and session.wall_s >= 3.0
    assert time.monotonic() - 3600 < process_start() <= time.monotonic()


def test_a_side_that_fails_is_one_line_and_the_other_side_keeps_its_blocks(
    tmp_path, fake_versions, monkeypatch
):
    versions, _ = fake_versions
    monkeypatch.setenv("FAKE_FAIL_B", "1")  # B's second launch (A B B) fails
    session, wrote = _run(versions, tmp_path / "out")
    assert session.error == "B = HEAD (" + str(tmp_path / "fake") + "): rank 1 failed: boom in B"
    assert "\n" not in session.error and session.stopped.startswith("stopped after 1 pairs")
    assert (tmp_path / "out" / "A" / "blocks").read_text() == "1"
    assert (tmp_path / "out" / "B" / "blocks").read_text() == "1"


@pytest.fixture
def ctrl_c_raises():
    """A SIGINT raises KeyboardInterrupt here, as at a terminal, even where the suite was
    started in the background (where the shell has SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _ctrl_c_once(log: Path, when, after_s: float = 0.0):
    """A Ctrl-C to this process ``after_s`` after the sides' log first satisfies ``when`` (not
    on a fixed timer: a loaded host starts sides late), by a watcher that the block ends."""
    stop = threading.Event()

    def watch():
        while not stop.wait(0.02):
            if log.exists() and when(log.read_text()):
                stop.wait(after_s)
                os.kill(os.getpid(), signal.SIGINT)
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


def test_ctrl_c_stops_the_launch_in_progress_and_both_sides_keep_what_finished(
    tmp_path, fake_versions, monkeypatch, ctrl_c_raises
):
    versions, log = fake_versions
    monkeypatch.setenv("FAKE_BLOCK_S", "1.0")
    with _ctrl_c_once(log, lambda text: text.count("\n") >= 3, after_s=0.1):  # third launch
        session, wrote = _run(versions, tmp_path / "out", pairs=6)
    assert session.interrupted and session.stopped.startswith("interrupted after")
    done = {k: int((tmp_path / "out" / k / "blocks").read_text()) for k in ("A", "B")}
    started = log.read_text().count("\n")
    assert sum(done.values()) == started - 1  # the launch in progress was dropped, no other
    assert all(f"{k}: {done[k]} block" in w for k, w in zip("AB", wrote, strict=True))


def test_gated_sides_open_both_launches_and_alternate_their_rounds(
    tmp_path, fake_versions, monkeypatch
):
    versions, log = fake_versions
    monkeypatch.setenv("FAKE_GATED", "1")
    session, wrote = _run(versions, tmp_path / "out", pairs=2)
    words = [line.split()[:2] for line in log.read_text().splitlines()]
    rounds = "".join(k for k, w in words if w == "round")
    assert rounds == "ABBAAB" + "BAABBA"  # A B B A within a pair; the second pair starts with B
    steps = [w if w != "open" else f"{k} open" for k, w in words]
    assert steps == [  # both closed at once: their log lines may come in either order
        "A open", "B open", *["round"] * 6, "close", "close",
        "B open", "A open", *["round"] * 6, "close", "close",
    ]  # fmt: skip
    assert [k for k, _ in session.launches] == ["A", "B", "B", "A"]
    assert all(m["gated"] == {"rounds": 3, "steps": 1} for _, m in session.launches)
    assert wrote == [f"A: 2 blocks in {tmp_path / 'out' / 'A'}", f"B: 2 blocks in {tmp_path / 'out' / 'B'}"]


def test_ctrl_c_in_a_gated_pair_drops_both_open_launches_and_keeps_the_pairs_before(
    tmp_path, fake_versions, monkeypatch, ctrl_c_raises
):
    versions, log = fake_versions
    monkeypatch.setenv("FAKE_GATED", "1")
    monkeypatch.setenv("FAKE_BLOCK_S", "0.3")
    with _ctrl_c_once(log, lambda text: text.count(" round ") >= 8):  # the second pair's rounds
        session, wrote = _run(versions, tmp_path / "out", pairs=4)
    assert session.interrupted and session.pairs_done() == 1
    assert [int((tmp_path / "out" / k / "blocks").read_text()) for k in "AB"] == [1, 1]


# ---------------------------------------------------------------------------------------------
# Environments


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def _tiny_repo(path: Path) -> Path:
    (path / "vpipe").mkdir(parents=True)
    (path / "vpipe" / "__init__.py").write_text("__version__ = '0'\n")
    (path / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "vpipe"\nversion = "0"\n[tool.setuptools.packages.find]\n'
        'include = ["vpipe*"]\n'
    )
    _git(path, "init", "-q")
    _git(path, "add", "-A")
    _git(path, "commit", "-qm", "good")
    return path


def test_a_revision_gets_a_worktree_and_an_environment_reused_while_unchanged(tmp_path):
    repo = _tiny_repo(tmp_path / "repo")
    cache = tmp_path / "cache"
    a = prepare("A", "HEAD", repo, cache)
    assert not a.reused and a.commit == _git(repo, "rev-parse", "HEAD")
    where = subprocess.run(
        [str(a.python), "-c", "import vpipe, numpy; print(vpipe.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert Path(where).parent.parent == a.checkout  # its own checkout; numpy shared from here
    again = prepare("B", "HEAD", repo, cache)
    assert again.reused and again.python == a.python


def test_an_environment_is_made_and_checked_without_the_callers_pythonpath(tmp_path, monkeypatch):
    # a developer's PYTHONPATH=<their checkout> (as bench.readme_commands sets it) once had the
    # new environment's check import that checkout's vpipe: "installed, but vpipe imports from"
    repo = _tiny_repo(tmp_path / "repo")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    a = prepare("A", "HEAD", repo, tmp_path / "cache")
    assert not a.reused and a.checkout != ROOT


def test_a_revision_that_fails_to_install_is_one_line_and_the_other_is_kept(tmp_path):
    repo = _tiny_repo(tmp_path / "repo")
    cache = tmp_path / "cache"
    good = prepare("A", "HEAD", repo, cache)
    (repo / "pyproject.toml").write_text("[project\nname = broken\n")
    _git(repo, "commit", "-qam", "broken")
    with pytest.raises(EnvError) as e:
        prepare("B", "HEAD", repo, cache)
    message = str(e.value)
    assert message.startswith("B (HEAD): install failed:") and "\n" not in message
    assert prepare("A", "HEAD~1", repo, cache).reused and good.python.exists()


def test_unknown_versions_are_one_line(tmp_path):
    repo = _tiny_repo(tmp_path / "repo")
    with pytest.raises(EnvError, match=r"^A \(nope\): neither a directory nor a git revision"):
        prepare("A", "nope", repo, tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EnvError, match="not a vpipe checkout"):
        prepare("B", str(tmp_path / "empty"), repo, tmp_path / "cache")


def test_a_paced_side_measures_memory_in_its_first_finished_block_only(tmp_path, monkeypatch):
    import io

    from vpipe.runtime import launch
    from vpipe.sweep import driver, paced

    asked = []

    def fake_sweep(spec, bench_id):
        asked.append(spec.memory_step)
        if len(asked) == 1:
            raise KeyboardInterrupt  # the first launch is stopped: the next one measures memory
        return [{"rank": 0, "times": [[0.1]], "refs": [[0.01]], "host_rounds": []}]

    monkeypatch.setattr(driver, "run_sweep", fake_sweep)
    monkeypatch.setattr(launch, "fork_server", lambda start=False: None)
    monkeypatch.setattr(paced, "write_blocks", lambda spec, blocks, *a: len(blocks))
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    spec = driver.SweepSpec(schedules=("1f1b",), microbatches=(2,), impls=("vpipe",), progress=False)
    assert paced.serve(spec, tmp_path / "out", io.StringIO("block\nblock\nblock\nend\n")) == 0
    assert asked == [True, True, False]
    assert "memory_step" not in driver.spec_dict(spec)  # not part of what the sweep is


def test_a_paced_side_runs_an_open_launchs_rounds_when_asked_and_drops_one_left_open(tmp_path):
    """Real ranks behind the gate (vpipe.sweep.gate): open, three rounds, close gives a block
    of three rounds; a command that is not a round or close drops the open launch; a launch
    still open at end is dropped, and the finished one is written."""
    cmd = [sys.executable, "-m", "vpipe", "bench", "--schedules", "1f1b", "--impl", "vpipe",
           "--microbatches", "2", "--batch", "8", "--sizes", "d_model=32,d_hidden=64",
           "--rounds", "3", "--steps", "1", "--warmup", "1", "--no-profile",
           "--out", str(tmp_path / "out"), "--paced"]  # fmt: skip
    script = "open\nround\nround\nround\nclose\nopen\nround\nblock\nopen\nround\nend\n"
    res = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    replies = [json.loads(line[len("vpipe-paced "):]) for line in res.stdout.splitlines()
               if line.startswith("vpipe-paced ")]  # fmt: skip
    assert replies[0]["gated"] == {"rounds": 3, "steps": 1}
    keys = [next(iter(r)) for r in replies[1:]]
    assert keys == ["opened", "round", "round", "round", "block",
                    "opened", "round", "failed", "opened", "round", "written"]  # fmt: skip
    assert len(replies[5]["steps"][0]) == 3  # one step in each of the three rounds
    assert "'block' in an open launch" in replies[8]["failed"]
    assert replies[-1]["written"] == 1


# ---------------------------------------------------------------------------------------------
# End to end


def test_vpipe_ab_of_this_checkout_against_itself(tmp_path):
    """Two real paced sides of this checkout (a directory version), a tiny sweep, two pairs."""
    out = tmp_path / "session"
    cmd = [sys.executable, "-m", "vpipe", "ab", str(ROOT), str(ROOT), "--schedules", "1f1b",
           "--impl", "vpipe", "--microbatches", "2", "--batch", "8", "--sizes",
           "d_model=32,d_hidden=64", "--rounds", "2", "--steps", "2", "--warmup", "1",
           "--pairs", "2", "--out", str(out), "--cache", str(tmp_path / "cache")]  # fmt: skip
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    md = (out / "report.md").read_text()
    assert "| verdict |" in md.replace("verdict | to settle", "verdict |")
    record = json.loads((out / "session.json").read_text())
    assert [x["side"] for x in record["launches"]] == ["A", "B", "B", "A"]
    assert {json.dumps(x["gated"]) for x in record["launches"]} == {'{"rounds": 2, "steps": 2}'}
    import pandas as pd

    for side in ("A", "B"):
        steps = pd.read_parquet(out / side / "steps.parquet")
        assert sorted(steps["block"].unique()) == [0, 1] and steps["ref_s"].notna().all()
        # memory is measured in the first block only (the one the store keeps), and kept
        ranks = pd.read_parquet(out / side / "ranks.parquet")
        assert (ranks["peak_bytes"] > 0).all()

    assert (out / "report.html").is_file() and "pair 2/2" in res.stdout
