"""The simulator's data-parallel reductions against timelines computed by hand: one stage
finishing early and one late, buckets queued on one collective stream, two stages of a V rank
queued behind each other, and an overlap action reduced after the whole compound."""

from __future__ import annotations

import math

import pytest

import vpipe
from vpipe.ir import Schedule, actions_from_strings
from vpipe.sim.collectives import (
    CollectiveCost,
    CollectiveError,
    bucket_sizes,
    simulate_reductions,
)


def _dp(schedule: Schedule, costs: str, cost: CollectiveCost, buckets: dict):
    """Simulated with ``costs`` per stage (the hand-computed timelines count in stage units)."""
    r = vpipe.simulate(schedule, vpipe.CostModel.parse(costs + ",unit=stage"))
    return r, simulate_reductions(schedule, r.columns, r.makespan, cost, buckets)


def _spans(step) -> list[tuple]:
    return [(x.rank, x.stage, x.bucket, x.ready, x.start, x.end) for x in step.reductions]


def test_ring_all_reduce_cost():
    c = CollectiveCost(group=4, bandwidth=2.0, latency=0.25, launch=1.0)
    # 1 + 2*3*0.25 + 2*3/4 * 8/2 = 1 + 1.5 + 6
    assert c.all_reduce(8) == 8.5
    assert CollectiveCost(group=1, bandwidth=1.0, latency=5).all_reduce(100) == 0.0
    assert CollectiveCost(group=8).all_reduce(10**9) == 0.0  # infinite bandwidth, no latency


def test_one_stage_early_one_late():
    # gpipe P=2 M=2, f=1, B=b+w=3: rank 1's last B ends at 9, rank 0's at 12.
    cost = CollectiveCost(group=2, bandwidth=1.0, latency=0.5)  # 4 bytes: 2*0.5 + 4 = 5
    r, step = _dp(vpipe.make_schedule("gpipe", 2, 2), "f=1,b=2,w=1", cost, {0: [4], 1: [4]})
    assert r.makespan == 12
    assert _spans(step) == [(0, 0, 0, 12, 12, 17), (1, 1, 0, 9, 9, 14)]
    assert step.step_end == 17 and step.exposed == 5 and step.hidden == 0
    assert step.dp_share == pytest.approx(5 / 17)


def test_buckets_queue_on_the_collective_stream():
    cost = CollectiveCost(group=2, bandwidth=1.0, latency=0.5)  # 3 bytes: 4; 1 byte: 2
    _, step = _dp(
        vpipe.make_schedule("gpipe", 2, 2), "f=1,b=2,w=1", cost, {0: bucket_sizes(4, 3), 1: [3, 1]}
    )
    assert _spans(step) == [
        (0, 0, 0, 12, 12, 16),
        (0, 0, 1, 12, 16, 18),
        (1, 1, 0, 9, 9, 13),
        (1, 1, 1, 9, 13, 15),
    ]
    assert step.step_end == 18 and step.exposed == 6 and step.hidden == 0


def test_buckets_reduced_inside_the_last_backward_when_it_fills_them():
    # the same timeline: rank 0's last B runs 9-12, rank 1's 6-9; two buckets each, ready a
    # half and all of the way through that B (Megatron-LM's --overlap-grad-reduce, DDP)
    cost = CollectiveCost(group=2, bandwidth=1.0, latency=0.5)  # 3 bytes: 4; 1 byte: 2
    sched = vpipe.make_schedule("gpipe", 2, 2)
    r = vpipe.simulate(sched, vpipe.CostModel.parse("f=1,b=2,w=1,unit=stage"))
    step = simulate_reductions(sched, r.columns, r.makespan, cost, {0: [3, 1], 1: [3, 1]},
                               within_backward=True)  # fmt: skip
    assert _spans(step) == [
        (0, 0, 0, 10.5, 10.5, 14.5),
        (0, 0, 1, 12, 14.5, 16.5),
        (1, 1, 0, 7.5, 7.5, 11.5),
        (1, 1, 1, 9, 11.5, 13.5),
    ]
    assert step.exposed == 4.5  # 1.5 less than after the backward (the test above: 6)


def test_reductions_hidden_when_they_fit_before_the_late_rank():
    # rank 1's reduction (9..11) ends before rank 0's gradients are even complete
    cost = CollectiveCost(group=2, bandwidth=1.0)
    _, step = _dp(vpipe.make_schedule("gpipe", 2, 2), "f=1,b=2,w=1", cost, {0: [0], 1: [2]})
    assert _spans(step) == [(0, 0, 0, 12, 12, 12), (1, 1, 0, 9, 9, 11)]
    assert step.exposed == 0 and step.hidden == 2 and step.dp_share == 0


def test_two_stages_of_a_v_rank_queue():
    # one rank holding stages 0 and 1: 0F0 [0,1] 1F0 [1,2] 1B0 [2,3] 0B0 [3,4]
    s = Schedule(1, 2, 1, {0: 0, 1: 0}, actions_from_strings([["0F0", "1F0", "1B0", "0B0"]]))
    cost = CollectiveCost(group=2, bandwidth=1.0)  # 2 bytes: 2
    _, step = _dp(s, "f=1,b=0.5,w=0.5", cost, {0: [2], 1: [2]})
    assert _spans(step) == [(0, 1, 0, 3, 3, 5), (0, 0, 0, 4, 5, 7)]
    assert step.step_end == 7 and step.exposed == 3 and step.hidden == 1


def test_an_overlap_action_reduces_after_the_whole_compound():
    # 0F0 [0,1] 1F0 [1,2] 0F1 [2,3] 1F1 [3,4] 1B0 [4,5]; (1B1;0B0): 1B1 [5,6], 0B0 [6,7];
    # 0B1 [7,8]. Stage 1's gradients are complete after the compound (7), not its part (6).
    rows = [["0F0", "1F0", "0F1", "1F1", "1B0", "(1B1;0B0)OVERLAP_F_B", "0B1"]]
    s = Schedule(1, 2, 2, {0: 0, 1: 0}, actions_from_strings(rows))
    cost = CollectiveCost(group=2, bandwidth=1.0)
    _, step = _dp(s, "f=1,b=0.5,w=0.5", cost, {0: [2], 1: [2]})
    assert _spans(step) == [(0, 1, 0, 7, 7, 9), (0, 0, 0, 8, 9, 11)]


def test_zero_bubble_reduces_after_the_deferred_w():
    # zb-h1 P=2 M=2 at unit costs: both ranks' last W ends at 7
    cost = CollectiveCost(group=2, bandwidth=1.0)
    _, step = _dp(vpipe.make_schedule("zb-h1", 2, 2), "f=1,b=1,w=1", cost, {0: [1], 1: [1]})
    assert [(x.ready, x.end) for x in step.reductions] == [(7, 8), (7, 8)]


def test_bad_collective_costs():
    with pytest.raises(CollectiveError, match="dp group size"):
        CollectiveCost(group=0)
    with pytest.raises(CollectiveError, match="bandwidth"):
        CollectiveCost(group=2, bandwidth=0)
    with pytest.raises(CollectiveError, match="latency"):
        CollectiveCost(group=2, latency=math.nan)
    with pytest.raises(CollectiveError, match="no gradient bytes for stage 1"):
        _dp(vpipe.make_schedule("gpipe", 2, 2), "f=1,b=1,w=1", CollectiveCost(2), {0: [1]})


def test_plan_with_dp_adds_the_reductions_and_changes_the_ranking():
    from vpipe.predict.dp_costs import DPCostError, DPCosts
    from vpipe.predict.plan import Budget, SpecCosts, candidates, recommend

    costs = SpecCosts.parse("f=1000,b=1000,w=1000,comm=50")
    kw = {"microbatches": [8], "schedules": ["zb-h1", "looped-bfs", "zbv"]}
    alone = candidates(costs, 4, 32, **kw)
    one = candidates(costs, 4, 32, dp=DPCosts.parse("grad_bytes=2e9,bw=25,lat=20", 1), **kw)
    assert [c.predicted_step_s for c in one] == [c.predicted_step_s for c in alone]
    eight = candidates(costs, 4, 256, dp=DPCosts.parse("grad_bytes=2e9,bw=25,lat=20", 8), **kw)
    for a, b in zip(alone, eight, strict=True):  # same per-replica work, plus the reductions
        assert b.predicted_step_s == pytest.approx(a.predicted_step_s + b.dp_exposed_s)
        assert b.dp_exposed_s > 0
    budget = Budget.parse("100units")
    assert recommend(alone, budget).schedule == "zb-h1"
    assert recommend(eight, budget).schedule == "looped-bfs"
    with pytest.raises(DPCostError, match="needs --dp-cost grad_bytes"):
        DPCosts.parse("lat=3", 8)
    with pytest.raises(DPCostError, match="bw=0: must be a number > 0"):
        DPCosts.parse("grad_bytes=1,bw=0", 8)


def test_plan_lookahead_advice_includes_the_reductions():
    from vpipe.predict.dp_costs import DPCosts
    from vpipe.predict.plan import Budget, SpecCosts, plan

    costs = SpecCosts.parse("f=1000,b=1000,w=1000,comm=50,handshake=400")
    kw = {"microbatches": [8], "schedules": ["1f1b"]}
    alone = plan(costs, 4, 32, Budget.parse("100units"), **kw)["recv_lookahead"]
    assert alone["best"] == 1  # posting receives early saves the handshakes: 3% of the step
    slow = DPCosts.parse("grad_bytes=2e10,bw=5,lat=20", 8)
    reduced = plan(costs, 4, 256, Budget.parse("100units"), dp=slow, **kw)["recv_lookahead"]
    # the same per-replica pipeline, each step ended by ~7 s of exposed reductions: the
    # lookahead's 4.5 ms are under 1% of the step, not worth the receive buffers
    extra = [reduced["predicted_step_s"][k] - alone["predicted_step_s"][k] for k in "0123"]
    assert all(e > 7 for e in extra)
    assert reduced["best"] == 0


def test_plan_with_dp_tries_microbatch_counts_of_the_replica_batch():
    from vpipe.predict.dp_costs import DPCosts
    from vpipe.predict.plan import SpecCosts, candidates

    costs = SpecCosts.parse("f=1000,b=1000,w=1000")
    found = candidates(costs, 2, 16, dp=DPCosts.parse("grad_bytes=1e8,bw=10", 2))
    assert {c.microbatches for c in found} == {1, 2, 4, 8}  # divisors of 16 / 2 replicas


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [("1f1b", 4, 8, None), ("zb-h1", 3, 6, None), ("interleaved-1f1b", 4, 8, 2),
     ("zbv", 4, 8, None), ("dualpipev", 4, 8, None), ("looped-bfs", 2, 4, 4)],
)  # fmt: skip
@pytest.mark.parametrize("lowered", [False, True])
def test_gradient_rows_follow_the_runtimes_rule(name, p, m, v, lowered):
    """The rows read off the flat columns are gradient_points' actions, counted in compute
    rows (an overlap action's parts are rows of their own)."""
    from vpipe.ir.lowering import lower
    from vpipe.ir.reduction import gradient_points
    from vpipe.schedules import make_schedule
    from vpipe.sim.collectives import gradient_rows

    s = make_schedule(name, p, m, v)
    s = lower(s) if lowered else s
    want = []
    for r in range(s.n_ranks):
        program = [a for a in s.actions[r] if a.is_compute]
        sizes = [len(a.compute_parts()) for a in program]
        points = gradient_points(program, s.stages_of(r))
        want.append([(sum(sizes[:at]), sizes[at], sorted(st)) for at, st in points.items()])
    assert gradient_rows(s) == want
