"""The block-built controllable-memory families (V-Min, V-Half, ZB-H2 of
:mod:`vpipe.schedules.controllable`; the catalogue's v-half and v-min are the cost-adapted ones,
tests/test_adaptive.py) against their docstrings' closed forms, exactly, with the simulator at f = b = w = c and no communication; the building blocks
and the W-filling list scheduler they are made of; properties under random integer costs.

Memory is the simulator's peak live stage-activations (F run, W not yet) per rank; a V stage
is half a 1F1B stage, so V figures are in half-stage units.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpipe.errors import ScheduleError
from vpipe.ir import Kind, Schedule, loop_placement, v_placement
from vpipe.ir.lowering import lower, validate
from vpipe.schedules import make_schedule
from vpipe.schedules.blocks import fi_peak, loop_block, plan, v_block
from vpipe.schedules.controllable import v_half, v_min, zb_h2
from vpipe.schedules.fill import fill
from vpipe.sim import CostModel, simulate

RANKS = range(1, 9)
MICRO = range(1, 33)


def _sim(s, c: float = 1):
    return simulate(s, CostModel(f=c, b=c, w=c))


def v_min_makespan(p: int, m: int) -> int:
    return 6 * m + (4 * p - 5 if p > 1 else 0)


def v_min_peak(p: int, m: int) -> int:
    return min(2 * m, 2 * ((p + 4) // 3))


def v_half_makespan(p: int, m: int) -> int:
    if p == 1:
        return 6 * m
    if p == 2:
        return 6 * m + max(2, 5 - 2 * m)
    return 6 * m + max(3 * p - 5, 4 * p - 3 - 2 * m)


def v_half_peak(p: int, m: int) -> int:
    return min(2 * m, p + 2)


def zb_h2_makespan(p: int, m: int) -> int:
    return 3 * m + p - 1 + max(0, p - m)


def zb_h2_peak(p: int, m: int) -> int:
    return min(m, 2 * p - 1)


BLOCK_BUILT = {"v-min": v_min, "v-half": v_half, "zb-h2": zb_h2}


def built(name: str, p: int, m: int):
    """The block-built family ``name``, or the catalogue's schedule of another name."""
    return BLOCK_BUILT[name](p, m) if name in BLOCK_BUILT else make_schedule(name, p, m)


CLOSED = {
    "v-min": (v_min_makespan, v_min_peak),
    "v-half": (v_half_makespan, v_half_peak),
    "zb-h2": (zb_h2_makespan, zb_h2_peak),
}


# ---------------------------------------------------------------------------------------------
# Closed forms, exactly


@pytest.mark.parametrize("name", sorted(CLOSED))
def test_closed_forms_at_unit_costs(name):
    """Makespan and the largest rank peak for P <= 8 and every M <= 32, as the docstring
    says; ZB-H2's ranks all reach it, V-Half's once M > P."""
    makespan, peak = CLOSED[name]
    for p in RANKS:
        for m in MICRO:
            res = _sim(built(name, p, m))
            assert res.makespan == makespan(p, m), (name, p, m)
            assert max(res.peak_stage_activations) == peak(p, m), (name, p, m)
            if name == "zb-h2" or (name == "v-half" and m > p):
                assert res.peak_stage_activations == [peak(p, m)] * p, (name, p, m)


@pytest.mark.parametrize("name", sorted(CLOSED))
def test_closed_forms_scale_with_the_costs(name):
    """f = b = w = 2: every time doubles, memory is unchanged."""
    makespan, peak = CLOSED[name]
    for p in (2, 5, 8):
        for m in (1, p, 3 * p):
            res = _sim(built(name, p, m), 2)
            assert res.makespan == 2 * makespan(p, m), (name, p, m)
            assert max(res.peak_stage_activations) == peak(p, m), (name, p, m)


def test_memory_shrinks_and_bubble_grows_from_zbv_to_v_half_to_v_min():
    """P >= 4, M >= 2P: V-Min holds less than V-Half, which holds less than ZB-V's 2P, and
    each pays with more idle time: 4P-5 > 3P-5 > P-1 per rank."""
    for p in range(4, 9):
        m = 2 * p
        runs = [_sim(built(n, p, m)) for n in ("v-min", "v-half", "zbv")]
        peaks = [max(r.peak_stage_activations) for r in runs]
        idle = [r.makespan - 6 * m for r in runs]
        assert peaks == [2 * ((p + 4) // 3), p + 2, 2 * p], p
        assert idle == [4 * p - 5, 3 * p - 5, p - 1], p
        assert peaks[0] < peaks[1] < peaks[2] and idle[0] > idle[1] > idle[2], p


def test_v_min_is_about_a_third_and_v_half_half_of_1f1b_memory():
    """In 1F1B stages (half the V figure): V-Min floor((P+4)/3), V-Half (P+2)/2, 1F1B P."""
    for p in RANKS:
        m = 4 * p
        one_f_one_b = max(_sim(make_schedule("1f1b", p, m)).peak_stage_activations)
        assert one_f_one_b == p
        assert max(_sim(built("v-min", p, m)).peak_stage_activations) / 2 == (p + 4) // 3
        assert max(_sim(built("v-half", p, m)).peak_stage_activations) / 2 == (p + 2) / 2


def test_zb_h2_zero_bubble_from_2p_minus_1_microbatches():
    """M >= 2P-1: every rank busy from its first to its last action; fewer: some gap; the
    whole step keeps the (P-1) skew, as ZB-H1 at f = b = w (whose peak is only P)."""
    for p in range(2, 9):
        for m in (2 * p - 1, 2 * p, 3 * p + 1):
            res = _sim(make_schedule("zb-h2", p, m))
            assert res.bubble_ratio_per_rank_excl_skew == [0.0] * p, (p, m)
            assert res.makespan == _sim(make_schedule("zb-h1", p, m)).makespan, (p, m)
        res = _sim(make_schedule("zb-h2", p, 2 * p - 2))
        assert max(res.bubble_ratio_per_rank_excl_skew) > 0, p


def test_zb_h2_beats_zb_h1_when_w_is_cheaper():
    """w < f = b (the zero-bubble paper's regime): ZB-H1 idles (P-1)(f+b-w), ZB-H2 less."""
    costs = CostModel(f=2, b=2, w=1)
    for p in range(2, 9):
        m = 3 * p
        h1 = simulate(make_schedule("zb-h1", p, m), costs).makespan
        h2 = simulate(make_schedule("zb-h2", p, m), costs).makespan
        assert h2 < h1, (p, h1, h2)


@pytest.mark.parametrize("name", sorted(CLOSED))
def test_other_stage_counts_are_refused(name):
    with pytest.raises(ScheduleError, match="stage"):
        BLOCK_BUILT[name](4, 8, 3)
    with pytest.raises(ScheduleError, match="stage"):
        make_schedule(name, 4, 8, 3)


# ---------------------------------------------------------------------------------------------
# Blocks and the list scheduler


def test_block_slots_follow_the_offsets():
    b = v_block(3, down=1, up=2, turn=4, gap=1, back_up=1, back_turn=4, back_down=2)
    f, i = b.slots()
    assert f == [0, 1, 2, 6, 8, 10]
    assert i == [21, 19, 17, 13, 12, 11]
    assert b.period == 6
    f, i = loop_block(3, forward=1, backward=5, gap=1).slots()
    assert (f, i) == ([0, 1, 2], [13, 8, 3])


def test_plan_orders_f_and_i_by_slot():
    orders = plan(loop_block(2, forward=1, backward=1, gap=1), loop_placement(2, 2), 2)
    assert [str(a) for a in orders[0]] == ["0F0", "0F1", "0I0", "0I1"]
    assert [str(a) for a in orders[1]] == ["1F0", "1I0", "1F1", "1I1"]
    assert fi_peak(orders) == 2


def test_fill_matches_the_simulator_and_respects_its_cap():
    """fill's own makespan and peaks are the simulator's (no communication cost; with some,
    the simulator's with receives posted early, and a lower bound of the default lowering's);
    a cap above the plan's need is respected and never stalls; one below it is refused."""
    p, m = 4, 10
    place = v_placement(p)
    orders = plan(v_block(p, down=1, up=5, turn=1, gap=1, back_up=1, back_turn=1, back_down=5),
                  place, m)
    need = fi_peak(orders)
    f, b, w = [1.0, 2.0] * p, [2.0, 1.0] * p, [1.0] * (2 * p)
    for cap in (need, need + 3):
        got = fill(place, orders, cap, f, b, w)
        s = Schedule(p, 2 * p, m, place, got.actions, "filled")
        validate(s)
        per_stage = {st: {"f": f[st], "b": b[st], "w": w[st]} for st in range(2 * p)}
        res = simulate(s, CostModel(per_stage=per_stage))
        assert res.makespan == got.makespan and res.peak_stage_activations == got.peaks
        assert max(got.peaks) <= cap
        hop = [1.0, 3.0] * p
        slow = fill(place, orders, cap, f, b, w, hop[: 2 * p - 1])
        costs = CostModel(per_stage=per_stage, comm_bytes=hop[: 2 * p - 1], comm_bandwidth=1)
        s = Schedule(p, 2 * p, m, place, slow.actions, "filled")
        assert simulate(s, costs, recv_lookahead=10**6).makespan == slow.makespan
        assert simulate(s, costs).makespan >= slow.makespan
    with pytest.raises(ScheduleError, match="cap"):
        fill(place, orders, 1, f, b, w)


def test_fill_times_a_complete_program_as_it_is():
    s = make_schedule("zbv", 3, 7)
    unit = [1.0] * 6
    got = fill(s.placement, s.actions, 0, unit, unit, unit)
    assert got.actions == s.actions
    res = _sim(s)
    assert (got.makespan, got.peaks) == (res.makespan, res.peak_stage_activations)
    s = make_schedule("1f1b", 3, 5)  # full backwards B
    got = fill(s.placement, s.actions, 0, unit[:3], unit[:3], unit[:3])
    res = _sim(s)
    assert (got.makespan, got.peaks) == (res.makespan, res.peak_stage_activations)


# ---------------------------------------------------------------------------------------------
# Properties under random costs


def _costs(draw, n_stages: int, comm: bool) -> CostModel:
    ints = st.integers(1, 6)
    per = {s: {"f": draw(ints), "b": draw(ints), "w": draw(ints)} for s in range(n_stages)}
    return CostModel(per_stage=per, comm_latency=draw(st.integers(0, 3)) if comm else 0)


@st.composite
def family_case(draw):
    name = draw(st.sampled_from(sorted(CLOSED)))
    p, m = draw(st.integers(1, 8)), draw(st.integers(1, 32))
    s = built(name, p, m)
    return name, s, _costs(draw, s.n_stages, comm=True)


@settings(max_examples=60, deadline=None)
@given(family_case())
def test_families_are_valid_and_keep_their_memory_under_any_costs(case):
    """Valid and deadlock free once lowered; the peak is the closed form (memory follows the
    program order, not the costs); without communication cost the makespan lies between the
    unit-cost closed form scaled by the least and by the largest cost (a fixed program run as
    soon as possible only slows down when an action does)."""
    name, s, costs = case
    p, m = s.n_ranks, s.n_microbatches
    validate(lower(s))
    res = simulate(s, costs)
    assert max(res.peak_stage_activations) == CLOSED[name][1](p, m)
    if costs.comm_latency == 0:
        times = [t for over in costs.per_stage.values() for t in over.values()]
        unit = CLOSED[name][0](p, m)
        assert min(times) * unit <= res.makespan <= max(times) * unit
    kinds = {part.kind for _, _, a in s.iter_actions() for part in a.compute_parts()}
    assert kinds <= {Kind.F, Kind.I, Kind.W}
