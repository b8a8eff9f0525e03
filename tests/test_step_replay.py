"""A measured step replayed with its own action times (vpipe.predict.step_replay)."""

import random

import pytest

from vpipe.predict.calibrate import calibrate, predict
from vpipe.predict.step_replay import action_times, own_bubbles
from vpipe.schedules import make_schedule
from vpipe.sim import CostModel, simulate

BASE = CostModel(f=10.0, b=8.0, w=6.0)  # a free link: simulated events carry no waits to fit one from


def _jittered(schedule, seed: int) -> dict:
    """Every compute part's time, its kind's base cost scaled by 0.5-2.5 (a loaded host)."""
    rng = random.Random(seed)
    base = {"F": BASE.f, "I": BASE.b, "W": BASE.w, "B": BASE.b + BASE.w}
    times = {}
    for acts in schedule.actions:
        for a in acts:
            for p in a.parts or (a,):
                times[p.stage, p.kind.value, p.microbatch] = base[p.kind.value] * rng.uniform(0.5, 2.5)
    return times


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zbv", "dualpipev", "zb-h1"])
def test_a_step_without_runtime_overhead_adds_nothing(name):
    """Events of a step simulated with jittered action times and no overhead: the replay
    recovers its bubble exactly, while the median-cost prediction misses it."""
    sched = make_schedule(name, 2, 8)
    times = _jittered(sched, 1)
    ev = simulate(sched, BASE, action_times=times).to_events("m", sched, time_unit_ns=1000)
    cal = calibrate(ev)
    table = own_bubbles(ev, cal, sched)
    assert table["added"].abs().max() < 1e-6  # times in whole ns
    assert abs(table["bubble"].iloc[0] - predict(cal, sched).bubble_ratio) > 1e-3  # not exact
    got = action_times(ev, cal)[0]
    assert sorted(got) == sorted(times)
    if not any(a.parts for acts in sched.actions for a in acts):
        assert all(got[k] == pytest.approx(t, abs=1e-3) for k, t in times.items())  # whole ns


def test_runtime_overhead_shows_up_as_added_bubble():
    """The same step with a per-action runtime cost (posting, gaps): the replay, which leaves
    them out, attributes exactly the bubble they add."""
    sched = make_schedule("zbv", 2, 8)
    times = _jittered(sched, 2)
    slow = CostModel(f=10.0, b=8.0, w=6.0, post=0.7, gap=0.3)
    ev = simulate(sched, slow, action_times=times).to_events("m", sched, time_unit_ns=1000)
    table = own_bubbles(ev, calibrate(ev), sched)
    with_ = simulate(sched, slow, action_times=times).bubble_ratio
    without = simulate(sched, BASE, action_times=times).bubble_ratio
    assert table["added"].iloc[0] == pytest.approx(with_ - without, abs=1e-6)
    assert table["added"].iloc[0] > 0.01


def test_an_overlap_action_is_split_by_calibrated_cost():
    """dualpipev's OVERLAP_F_B parts share one traced interval: their times sum to it, split
    in proportion to the parts' calibrated costs."""
    sched = make_schedule("dualpipev", 2, 8)
    ev = simulate(sched, BASE).to_events("m", sched, time_unit_ns=1000)
    # the simulator names parts on their own; a trace names both by their compound
    compound = ev[ev["name"].astype(str).isin(["0F3", "3B1"])]
    span = (compound["end_ns"].max() - compound["start_ns"].min()) / 1000
    ev["name"] = ev["name"].astype(str)
    ev.loc[compound.index, "name"] = "(0F3;3B1)OVERLAP_F_B"
    ev.loc[compound.index, "start_ns"] = compound["start_ns"].min()
    ev.loc[compound.index, "end_ns"] = compound["end_ns"].max()
    cal = calibrate(ev)
    got = action_times(ev, cal)[0]
    keys = [(int(r.stage), str(r.kind), int(r.microbatch)) for r in compound.itertuples()]
    assert sum(got[k] for k in keys) == pytest.approx(span)
    cost = {"F": cal.f, "B": cal.b + cal.w, "I": cal.b, "W": cal.w}
    own = [float(cost[k][s]) for s, k, _ in keys]
    assert got[keys[0]] / got[keys[1]] == pytest.approx(own[0] / own[1])


def test_simulate_takes_some_actions_times():
    """Given times replace the cost model's for those parts only: a rank's busy time moves by
    exactly the change."""
    sched = make_schedule("1f1b", 2, 4)
    plain = simulate(sched, BASE)
    longer = simulate(sched, BASE, action_times={(0, "F", 2): 25.0})
    assert longer.busy[0] == pytest.approx(plain.busy[0] + 15.0)
    assert longer.busy[1] == pytest.approx(plain.busy[1])
