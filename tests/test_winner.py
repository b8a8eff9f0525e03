"""A sweep's verdict (within-run, paired): the schedule to run, or a tie broken by the tie rule
and why; which configs more rounds could still order; and merging blocks."""

from __future__ import annotations

import numpy as np
import pandas as pd

from vpipe.report.winner import open_configs, standings, verdict_lines
from vpipe.sweep.blocks import merge_blocks


def _steps(times: dict[str, float], noise: float, rounds: int = 3, steps: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(rounds):
        for k in range(steps):
            host = 1 + noise * rng.standard_normal()  # shared by the round's pair
            for sched, t in times.items():
                jitter = 1 + noise * rng.standard_normal()
                rows.append(dict(schedule=sched, microbatches=4, impl="vpipe", round=r, step=k,
                                 step_time_s=t * host * jitter))  # fmt: skip
    return pd.DataFrame(rows)


def test_a_clear_winner_is_named_with_its_interval():
    steps = _steps({"1f1b": 0.10, "zbv": 0.08, "zb-h1": 0.09}, noise=0.01)
    (line,) = verdict_lines(steps)
    assert line.startswith("M=4 vpipe: run zbv: 1.1")  # zb-h1 is the next fastest
    assert "faster than zb-h1, the next fastest by median step time (paired ratio, 95% CI 1." in line
    assert "every other schedule is slower" in line
    assert open_configs(steps) == set()  # decided: no round would change it


def test_the_next_fastest_is_the_second_median_not_the_smallest_paired_ratio():
    # zb-h1 has the second lowest median, 1f1b the smallest paired ratio to zbv's steps (its
    # steps follow zbv's): the verdict names zb-h1, as the summary table orders them
    zbv = [1.0] * 4 + [2.0] * 5
    sched = {"zbv": zbv, "1f1b": [1.5 * t for t in zbv],
             "zb-h1": [1.65] * 4 + [3.3] + [2.25] * 4}  # fmt: skip
    rows = [dict(schedule=s, microbatches=4, impl="vpipe", round=i // 3, step=i % 3,
                 step_time_s=0.05 * t * (1 + 1e-4 * i)) for s, ts in sched.items()
            for i, t in enumerate(ts)]  # fmt: skip
    steps = pd.DataFrame(rows)
    (st,) = standings(steps)
    assert st.leader == "zbv" and st.contenders == ["zbv"]
    assert min(st.ratios, key=lambda s: st.ratios[s].value) == "1f1b"  # what it once named
    (line,) = verdict_lines(steps)
    assert "faster than zb-h1, the next fastest by median step time" in line, line


def test_an_interval_that_excludes_1_never_prints_an_end_of_1():
    from vpipe.stats import interval_text

    assert interval_text(1.004, 1.07) == "1.004-1.070"  # not "1.00-1.07"
    assert interval_text(0.93, 0.997) == "0.930-0.997"
    assert interval_text(1.01, 1.07) == "1.01-1.07"
    assert interval_text(0.99, 1.07) == "0.99-1.07"  # it holds 1: as it is
    steps = _steps({"1f1b": 0.1035, "zbv": 0.100}, noise=0.002, rounds=6)
    (line,) = verdict_lines(steps)
    low = float(line.split("95% CI ")[1].split("-")[0])
    assert "run zbv" in line and low > 1, line


def test_schedules_within_two_percent_are_a_tie_broken_by_less_memory():
    steps = _steps({"zbv": 0.100, "1f1b": 0.1002}, noise=0.002, rounds=6)
    (st,) = standings(steps)
    assert st.status == {st.contenders[1]: "tied"}
    memory = {("zbv", 4, "vpipe"): 8 * 2**20, ("1f1b", 4, "vpipe"): 6 * 2**20}
    (line,) = verdict_lines(steps, memory)
    assert line.startswith("M=4 vpipe: run 1f1b: a tie of ")  # less memory, though not faster
    assert "each within 2% of it" in line and "picked by the tie rule: less memory (" in line
    assert "1f1b 6.00 MiB" in line
    # with equal memory the simpler schedule runs: 1f1b (one stage per rank) before zbv (two)
    same = {k: 6 * 2**20 for k in memory}
    assert verdict_lines(steps, same)[0].startswith("M=4 vpipe: run 1f1b: ")
    assert open_configs(steps) == set()


def test_an_undecided_order_is_open_and_the_verdict_says_why():
    steps = _steps({"1f1b": 0.100, "zbv": 0.099}, noise=0.08)
    (st,) = standings(steps)
    assert st.open == [st.contenders[1]]
    # more rounds go to the open contender and the leader it is paired with, nothing else
    assert open_configs(steps) == {("1f1b", 4, "vpipe"), ("zbv", 4, "vpipe")}
    (line,) = verdict_lines(steps, {}, "in 3 rounds, when the time budget ran out")
    assert " a tie of " in line and "not told apart from 1f1b in 3 rounds, when the time budget ran out" in line
    assert "rounds in all would settle zbv" in line
    assert verdict_lines(_steps({"zbv": 0.1}, noise=0.0)) == [
        "one schedule per group: nothing to rank"
    ]


def test_a_slower_schedule_leaves_the_open_set_while_the_rest_stay():
    # zb-h1 is clearly slower; 1f1b and zbv cannot be told apart at this noise
    steps = _steps({"1f1b": 0.100, "zbv": 0.0995, "zb-h1": 0.2}, noise=0.05)
    (st,) = standings(steps)
    assert st.status["zb-h1"] == "slower" and "zb-h1" not in st.contenders
    assert ("zb-h1", 4, "vpipe") not in open_configs(steps)


def test_merge_blocks_appends_every_blocks_steps_and_numbers_rounds_on():
    def rank(r, t):
        return {"rank": r, "times": [[t, t], [2 * t, 2 * t]], "refs": [[1, 1], [1, 1]],
                "rounds": [[0, 1], [0, 1]], "comm_thread_cpu_s": [[t / 10], [t / 5]],
                "host_rounds": [{"load1": t, "round": 0}, {"load1": t, "round": 1}],
                "memory": {}}  # fmt: skip

    merged = merge_blocks([[rank(1, 0.1), rank(0, 0.1)], [rank(0, 0.3), rank(1, 0.3)]])
    assert [m["rank"] for m in merged] == [0, 1]
    assert merged[0]["times"] == [[0.1, 0.1, 0.3, 0.3], [0.2, 0.2, 0.6, 0.6]]
    assert merged[0]["refs"] == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert merged[0]["comm_thread_cpu_s"] == [[0.01, 0.03], [0.02, 0.06]]  # one per round
    assert merged[0]["rounds"] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert merged[0]["blocks"] == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert [(h["block"], h["round"], h["load1"]) for h in merged[0]["host_rounds"]] == [
        (0, 0, 0.1), (0, 1, 0.1), (1, 2, 0.3), (1, 3, 0.3)
    ]  # fmt: skip


def _rounds(times: dict[str, float], noise: float, deadline: float | None, precision=0.0):
    """A rank's Rounds after 3 base rounds of synthetic step times (no launch), adding rounds
    to medians known to worse than +-``precision`` percent."""
    from types import SimpleNamespace

    from vpipe.sweep.driver import Config
    from vpipe.sweep.rounds import Rounds

    steps = _steps(times, noise)
    configs = [Config(s, 4, "vpipe") for s in times]
    spec = SimpleNamespace(steps=3, deadline=deadline, timing_precision=precision)
    rounds = Rounds(spec, configs, [None] * len(configs), None, 0, lambda what: None)
    for i, c in enumerate(configs):
        mine = steps[steps["schedule"] == c.schedule]
        rounds.times[i], rounds.rounds[i] = list(mine["step_time_s"]), list(mine["round"])
        rounds.seconds[i] = [0.5, 0.5, 0.5]  # wall seconds of each of its rounds
    return rounds


def test_rounds_go_to_open_configs_while_they_fit_before_the_deadline():
    import time

    from vpipe.sweep.rounds import OUTPUT_RESERVE_S

    close = {"1f1b": 0.100, "zbv": 0.099, "zb-h1": 0.3}  # zb-h1: clearly slower
    later = time.time() + 3600
    r = _rounds(close, noise=0.08, deadline=later)
    assert r._choose() == [0, 1] and r.stop == "fixed"  # the open pair and its leader only
    # the next round (2 x 0.5 s), the memory steps and the outputs no longer fit: stop
    r = _rounds(close, noise=0.08, deadline=time.time() + OUTPUT_RESERVE_S + 0.5)
    assert r._choose() == [] and r.stop == "budget"
    r = _rounds({"1f1b": 0.10, "zbv": 0.08}, noise=0.01, deadline=later)
    assert r._choose() == [] and r.stop == "decided"
    r = _rounds(close, noise=0.08, deadline=None)  # no budget: the rounds are fixed
    assert r._choose() == [] and r.stop == "fixed"


def test_rounds_also_go_to_medians_not_yet_known_to_the_precision_asked():
    import time

    from vpipe.stats import median_precision

    later = time.time() + 3600
    apart = {"1f1b": 0.10, "zbv": 0.08, "zb-h1": 0.3}  # ordered: no rounds for the verdict
    assert _rounds(apart, noise=0.01, deadline=later)._choose() == []
    r = _rounds(apart, noise=0.05, deadline=later, precision=3.0)
    known = [median_precision(t) * 100 for t in r.times]
    assert r._choose() == [i for i, p in enumerate(known) if p > 3.0] != []
    assert r.stop == "fixed"  # rounds go on
    r = _rounds(apart, noise=0.05, deadline=later, precision=50.0)  # all known well enough
    assert r._choose() == [] and r.stop == "decided"
    r = _rounds({"zbv": 0.08}, noise=0.001, deadline=later, precision=3.0)  # nothing to order
    assert r._choose() == []
    r.times[0], r.rounds[0] = r.times[0][:5], r.rounds[0][:5]  # too few for an interval
    assert r._choose() == [0]


def test_a_medians_precision_is_its_bootstrap_interval_relative_to_it():
    from vpipe.stats import median_precision

    steady = np.full(20, 0.1) * (1 + 0.001 * np.arange(20))
    assert 0 < median_precision(steady) < 0.01
    spread = 0.1 * (1 + 0.2 * np.random.default_rng(1).standard_normal(20))
    assert median_precision(spread) > 5 * median_precision(steady)
    assert median_precision(np.append(steady, 10.0)) == median_precision(steady)  # an outlier
    assert np.isnan(median_precision(steady[:5]))
