"""auto_schedule: the fastest building-block schedule under a cost model and a memory limit.

Properties over P <= 8, M <= 32 and random integer costs: it never exceeds its limit (in 1F1B
stages: a V rank's peak halved), with no communication cost its own makespan is the
simulator's, and it is never slower than a fixed family of its placement that fits the limit
(ZB-V with a generous limit in particular).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpipe.errors import ScheduleError
from vpipe.ir import loop_placement, v_placement
from vpipe.ir.lowering import lower, validate
from vpipe.schedules import make_schedule
from vpipe.schedules.auto import auto_schedule
from vpipe.schedules.controllable import v_half, v_min, zb_h2
from vpipe.schedules.interleaved import zb_h1
from vpipe.schedules.simple import one_f_one_b
from vpipe.schedules.v import zbv
from vpipe.sim import CostModel, simulate

# the fixed families auto weighs (V-Half and V-Min block-built: the catalogue's names give
# the cost-adapted ones)
FIXED = {"v": (zbv, v_half, v_min), "loop": (one_f_one_b, zb_h1, zb_h2)}
BUDGET = 20_000  # a small list-scheduler search: these properties hold for any budget


def _memory(res, spr: int) -> float:
    """A run's peak in 1F1B stages."""
    return max(res.peak_stage_activations) / spr


@st.composite
def case(draw, comm: bool):
    placement = draw(st.sampled_from(["v", "loop"]))
    spr = 2 if placement == "v" else 1
    p, m = draw(st.integers(1, 8)), draw(st.integers(1, 32))
    ints = st.integers(1, 6)
    per = {s: {"f": draw(ints), "b": draw(ints), "w": draw(ints)} for s in range(spr * p)}
    latency = draw(st.integers(0, 3)) if comm else 0
    limit = draw(st.integers(spr, 4 * p * spr)) / spr  # 1 .. 4P 1F1B stages, halves on the V
    return placement, p, m, CostModel(per_stage=per, comm_latency=latency), limit


@settings(max_examples=30, deadline=None)
@given(case(comm=True))
def test_auto_never_exceeds_its_limit(c):
    placement, p, m, costs, limit = c
    s = auto_schedule(p, m, costs, limit, placement, search_budget=BUDGET)
    spr = 2 if placement == "v" else 1
    place = v_placement(p) if placement == "v" else loop_placement(p, p)
    assert (s.name, s.n_ranks, s.n_microbatches, s.placement) == ("auto", p, m, place)
    validate(lower(s))
    res = simulate(s, costs)
    assert _memory(res, spr) <= limit
    if s.meta["cap"] is not None:  # a filled block, not a fixed family
        assert max(res.peak_stage_activations) <= s.meta["cap"]


@settings(max_examples=30, deadline=None)
@given(case(comm=False))
def test_auto_is_never_slower_than_a_fixed_family_that_fits(c):
    """No communication cost: auto's makespan is the simulator's, and no fixed family of its
    placement whose peak fits the limit is faster; with a limit of at least ZB-V's (P 1F1B
    stages) that includes ZB-V."""
    placement, p, m, costs, limit = c
    spr = 2 if placement == "v" else 1
    s = auto_schedule(p, m, costs, limit, placement, search_budget=BUDGET)
    mine = simulate(s, costs)
    for family in FIXED[placement]:
        name = family.__name__
        other = simulate(family(p, m), costs)
        if _memory(other, spr) <= limit:
            assert mine.makespan <= other.makespan, name
    if placement == "v" and limit >= p:
        assert mine.makespan <= simulate(make_schedule("zbv", p, m), costs).makespan


@pytest.mark.parametrize(
    "placement,p,m,costs,family,makespan",
    [
        ("loop", 3, 3, CostModel(f=1, b=2, w=2), "zb-h1", 19),  # the best block: 21
        ("v", 2, 4, CostModel(f=2, b=1, w=2), "zbv", 42),  # the best block: 43
    ],
)
def test_a_fixed_family_is_matched_where_every_block_is_slower(
    placement, p, m, costs, family, makespan
):
    """Cases where every filled block is slower than a fixed family: auto is at least as fast
    as the family (the list scheduler ties it, or the family itself is taken)."""
    s = auto_schedule(p, m, costs, 2 * p, placement)
    assert simulate(make_schedule(family, p, m), costs).makespan == makespan
    assert simulate(s, costs).makespan <= makespan


def test_less_memory_costs_time():
    """Unit costs, P = 8, M = 24: the limit controls the trade-off, from one microbatch in
    flight (one 1F1B stage) to ZB-V's zero bubble at P stages."""
    costs = CostModel()
    runs = {
        lim: simulate(auto_schedule(8, 24, costs, lim, search_budget=BUDGET), costs)
        for lim in (1, 2, 4, 5, 8)
    }
    idle = {lim: r.makespan - 6 * 24 for lim, r in runs.items()}
    assert idle[8] == 7  # ZB-V's P - 1
    assert idle[5] <= 19 and idle[4] <= 27  # V-Half's 3P - 5, V-Min's 4P - 5
    assert idle[1] > idle[2] > idle[4] > idle[5] > idle[8]
    for lim, r in runs.items():
        assert _memory(r, 2) <= lim


def test_catalogue_row_uses_unit_costs_and_twice_1f1b_memory():
    costs = CostModel()
    for p in range(1, 9):
        for m in (1, p, 2 * p + 1, 3 * p):
            s = make_schedule("auto", p, m)
            assert s.meta["memory_limit"] == 2 * p and s.stages_per_rank == 2
            res = simulate(s, costs)
            assert _memory(res, 2) <= 2 * p
            assert res.makespan <= simulate(make_schedule("zbv", p, m), costs).makespan


def test_a_limit_of_one_stage_keeps_one_microbatch_in_flight():
    costs = CostModel()
    for placement, spr in (("v", 2), ("loop", 1)):
        s = auto_schedule(4, 6, costs, 1, placement)
        assert max(simulate(s, costs).peak_stage_activations) == spr


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"memory_limit": 0.5}, "smallest feasible limit is 1"),
        ({"memory_limit": math.nan}, "must be a number"),
        ({"memory_limit": "2"}, "must be a number"),
        ({"memory_limit": 4, "placement": "zigzag"}, "placement"),
    ],
)
def test_bad_arguments_are_refused(kwargs, needle):
    with pytest.raises(ScheduleError, match=needle):
        auto_schedule(4, 8, CostModel(), **kwargs)


def test_an_infinite_limit_is_the_fastest_without_a_cap():
    costs = CostModel(f=1, b=2, w=1)
    s = auto_schedule(4, 8, costs, math.inf)
    assert simulate(s, costs).makespan <= simulate(make_schedule("zbv", 4, 8), costs).makespan
