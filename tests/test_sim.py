"""Tests of the simulator (vpipe.sim.simulator): closed forms, hand-computed timelines, an independent
check of the event semantics on random schedules, exports and the cost model."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_passes import gpipe, greedy, one_f_one_b

from vpipe.errors import VpipeError
from vpipe.events import EVENT_COLUMNS
from vpipe.ir import Action, Kind, Schedule, actions_from_strings, loop_placement, v_placement
from vpipe.ir.lowering import lower
from vpipe.schedules import make_schedule, schedule_names
from vpipe.sim import CostModel, CostModelError, simulate

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W


@pytest.mark.parametrize("P,M", [(1, 1), (2, 3), (4, 4), (4, 9), (7, 3)])
@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_gpipe_1f1b_closed_form(make, P, M):
    r = simulate(make(P, M))
    assert r.makespan == pytest.approx(3 * (M + P - 1))
    assert r.bubble_ratio == pytest.approx((P - 1) / (M + P - 1))
    assert r.bubble_ratio_per_rank == pytest.approx([(P - 1) / (M + P - 1)] * P)
    # Excluding skew: rank r starts at r and its last backward ends at makespan - 2r.
    span = [3 * (M + P - 1) - 3 * r for r in range(P)]
    assert r.bubble_ratio_per_rank_excl_skew == pytest.approx([(s - 3 * M) / s for s in span])
    assert r.bubble_ratio_excl_skew == pytest.approx(sum(s - 3 * M for s in span) / sum(span))


def test_peak_activations_1f1b_and_gpipe():
    P, M = 4, 8
    assert simulate(one_f_one_b(P, M)).peak_stage_activations == [P - r for r in range(P)]
    r = simulate(gpipe(P, M), CostModel(activation_bytes=[10, 20, 30, 40]))
    assert r.peak_stage_activations == [M] * P
    assert r.peak_activation_bytes == [M * 10, M * 20, M * 30, M * 40]
    assert simulate(gpipe(P, M)).peak_activation_bytes is None


def test_split_backward_keeps_activation_live_until_w():
    rows = [["0F0", "0I0", "0F1", "0I1", "0W0", "0W1"]]
    s = Schedule(1, 1, 2, {0: 0}, actions_from_strings(rows))
    assert simulate(s).peak_stage_activations == [2]
    rows = [["0F0", "0I0", "0W0", "0F1", "0I1", "0W1"]]
    s = Schedule(1, 1, 2, {0: 0}, actions_from_strings(rows))
    assert simulate(s).peak_stage_activations == [1]


def test_hand_computed_timeline_with_latency():
    # 2 ranks, 1 microbatch: F0 [0,1], message 0.5, F1 [1.5,2.5], B1 [2.5,4.5], B0 [5,7].
    r = simulate(one_f_one_b(2, 1), CostModel(comm_latency=0.5))
    tl = r.timeline
    rows = {n: (s, e) for n, s, e in zip(tl["name"], tl["start"], tl["end"], strict=True)}
    assert rows["0F0"] == (0, 1)
    assert rows["0SEND_F0"] == (1, 1.5)
    assert rows["1RECV_F0"] == (0, 1.5)
    assert rows["1F0"] == (1.5, 2.5)
    assert rows["1B0"] == (2.5, 4.5)
    assert rows["0B0"] == (5, 7)
    assert r.makespan == 7
    assert r.comm_ops == [2, 2]


def test_transfer_starts_when_both_sides_posted():
    # Rank 1 posts RECV_F1 only after B0: the transfer starts then, not at the send.
    late = [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
    ]
    s = Schedule(2, 2, 2, loop_placement(2, 2), actions_from_strings(late))
    tl = simulate(s, CostModel(comm_latency=0.5)).timeline.set_index("name")
    assert tl.loc["1F0", "start"] == 1.5
    assert tl.loc["1RECV_F1", "start"] == 4.5
    assert tl.loc["1F1", "start"] == 5.0
    # Posted early (lowering's default), the same transfer overlaps B0.
    tl = simulate(one_f_one_b(2, 2), CostModel(comm_latency=0.5)).timeline.set_index("name")
    assert tl.loc["1F1", "start"] == 4.5


def test_handshake_charges_only_receives_posted_after_their_send():
    """gloo's rendezvous: a receive posted after its send costs ``comm_handshake`` more; one
    posted before costs the latency alone, so the lookahead now matters."""
    late = [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
    ]
    s = Schedule(2, 2, 2, loop_placement(2, 2), actions_from_strings(late))
    costs = CostModel(comm_latency=0.5, comm_handshake=2.0)
    tl = simulate(s, costs).timeline.set_index("name")
    assert tl.loc["1F0", "start"] == 1.5  # RECV_F0 posted at 0, before the send at 1
    assert tl.loc["1F1", "start"] == 4.5 + 0.5 + 2.0  # posted at 4.5, sent at 2
    # B0 and B1 go back to receives posted before their sends: no handshake
    assert tl.loc["0B0", "start"] == tl.loc["1B0", "end"] + 0.5
    # lowered with lookahead 1, RECV_F1 is posted after 1F0 (2.5), after the send (2)
    one = simulate(one_f_one_b(2, 2), costs).timeline.set_index("name")
    assert one.loc["1F1", "start"] == 2.5 + 0.5 + 2.0
    # with lookahead 2 it is posted at the start: F1 waits only for rank 1's own B0
    two = simulate(one_f_one_b(2, 2), costs, recv_lookahead=2).timeline.set_index("name")
    assert two.loc["1F1", "start"] == 4.5
    assert CostModel.parse("handshake=2").comm_handshake == 2.0
    with pytest.raises(CostModelError, match="comm_handshake"):
        CostModel(comm_handshake=-1)


def test_bytes_bandwidth_and_per_stage_costs():
    costs = CostModel(comm_bytes=[100.0], comm_bandwidth=50.0, per_stage={1: {"f": 3.0, "w": 0}})
    r = simulate(one_f_one_b(2, 1), costs)
    # F0 1, message 2, F1 3, B1 (b+w = 1+0) 1, message 2, B0 2
    assert r.makespan == 11
    assert r.busy == [3, 4]


def test_overlap_action_costs_sum_of_parts():
    s = make_schedule("dualpipev", 2, 6)
    assert any(a.kind is Kind.OVERLAP_F_B for acts in s.actions for a in acts)
    r = simulate(s, CostModel(f=1, b=2, w=3))
    busy_expected = [2 * 6 * (1 + (2 + 3))] * 2  # 2 stages x 6 microbatches x (f + (b + w))
    assert r.busy == busy_expected
    tl = r.timeline
    for acts_r, rank in zip(s.actions, range(2), strict=True):
        for a in acts_r:
            if a.kind is Kind.OVERLAP_F_B:
                names = [str(p) for p in a.parts]
                rows = tl[(tl["rank"] == rank) & tl["name"].isin(names)].set_index("name")
                first, second = rows.loc[names[0]], rows.loc[names[1]]
                assert first["end"] <= second["start"]


def _check_event_semantics(s: Schedule, costs: CostModel) -> None:
    """Independent check of a simulated timeline: per rank, compute never overlaps and runs in
    program order; every cross-stage input has arrived (end of the producing action + message
    cost, or the producer's end on the same rank) before its consumer starts; no rank idles
    without a reason: each compute action starts at its predecessor's end (0 for the first)
    or when its remote input arrives (each part of an overlap action waits for its own input,
    just before it runs)."""
    r = simulate(s, costs)
    tl = r.timeline
    comp = tl[tl["kind"].isin(["F", "B", "I", "W"])]
    end = {}
    start = {}
    for row in comp.itertuples():
        key = (row.stage, _group(row.kind), row.microbatch)
        end[key], start[key] = row.end, row.start
    cost = costs.comm_latency  # comm_bytes default 0
    place, S = s.placement, s.n_stages
    # An overlap action's outputs are sent when the whole action ends.
    sent: dict[tuple, float] = {}
    for acts in s.actions:
        for a in acts:
            keys = [(p.stage, _group(p.kind.value), p.microbatch) for p in a.parts or (a,)]
            for k in keys:
                sent[k] = end[keys[-1]]
    remote: dict[tuple, float] = {}
    for (stage, k, m), t0 in start.items():
        need = []
        if k == "F" and stage > 0:
            need.append((stage - 1, "F", m))
        if k == "BK" and stage < S - 1:
            need.append((stage + 1, "BK", m))
        if k == "W":
            need.append((stage, "BK", m))
        for p in need:
            if place[p[0]] != place[stage]:
                remote[(stage, k, m)] = sent[p] + cost
                assert t0 >= sent[p] + cost - 1e-9, (stage, k, m)
            else:
                assert t0 >= end[p] - 1e-9, (stage, k, m)
    for rank in range(s.n_ranks):
        rows = comp[comp["rank"] == rank]
        prev_end = 0.0
        ends = [0.0]
        for row in rows.itertuples():
            assert row.start >= prev_end - 1e-9
            key = (row.stage, _group(row.kind), row.microbatch)
            # Either the rank was busy until now, or the part's remote input arrived now: at
            # its producer's end plus the message cost, or (receive posted late) at the end of
            # an earlier action of this rank plus the cost.
            arr = [remote[key]] if key in remote else []
            reasons = [prev_end, *arr]
            if arr:
                reasons += [x + cost for x in ends]
            assert any(abs(row.start - x) < 1e-9 for x in reasons), row
            assert row.start <= max([prev_end + cost, *arr]) + 1e-9
            prev_end = row.end
            ends.append(row.end)


def _group(kind: str) -> str:
    return "F" if kind == "F" else ("W" if kind == "W" else "BK")


@settings(max_examples=30, deadline=None)
@given(
    P=st.integers(1, 4),
    M=st.integers(1, 5),
    v=st.booleans(),
    split=st.booleans(),
    fuse=st.booleans(),
    seed=st.integers(0, 1000),
    lat=st.sampled_from([0.0, 0.5, 2.0]),
    f=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_random_schedules_respect_event_semantics(P, M, v, split, fuse, seed, lat, f):
    placement = v_placement(P) if v else loop_placement(P, 2 * P)
    s = greedy(P, M, placement, split=split, seed=seed, overlap_pairs=fuse)
    _check_event_semantics(s, CostModel(f=f, b=1.0, w=0.5, comm_latency=lat))


@pytest.mark.parametrize("name", ["dualpipev", "zbv", "interleaved-1f1b"])
def test_builtin_schedules_respect_event_semantics(name):
    for lat in (0.0, 0.7):
        _check_event_semantics(
            make_schedule(name, 3, 6), CostModel(f=1.5, b=1, w=0.5, comm_latency=lat)
        )


@pytest.mark.parametrize("name", sorted(schedule_names()))
def test_every_builtin_schedule_simulates_same_lowered_or_not(name):
    costs = CostModel(f=1, b=1.5, w=0.5, comm_latency=0.25)
    for P in (1, 2, 3, 4):
        for M in (1, 4, 8):
            try:
                s = make_schedule(name, P, M)
            except VpipeError:
                continue
            r = simulate(s, costs)
            r2 = simulate(lower(s), costs)
            assert r.to_dict() == r2.to_dict()
            assert r.timeline.equals(r2.timeline)
            busy = sum(r.busy)
            assert 0 <= r.bubble_ratio < 1 or P == 1
            assert r.makespan * P >= busy - 1e-9
            if P > 1:
                low = lower(s)
                assert r.comm_ops == [sum(a.is_comm for a in acts) for acts in low.actions]


def test_zbv_uses_no_comm_on_last_rank_local_handoff():
    P = 4
    s = make_schedule("zbv", P, 8)
    r = simulate(s)
    comm = r.timeline[r.timeline["kind"].astype(str).str.contains("_")]
    last = comm[comm["rank"] == P - 1]
    assert not ((last["kind"] == "SEND_F") & (last["stage"] == P - 1)).any()
    assert not ((last["kind"] == "RECV_F") & (last["stage"] == P)).any()


def test_to_dict_events_and_chrome_trace(tmp_path):
    s = one_f_one_b(3, 4)
    r = simulate(s, CostModel(comm_latency=0.5))
    d = r.to_dict()
    for key in (
        "makespan",
        "bubble_ratio",
        "bubble_ratio_per_rank",
        "bubble_ratio_excl_skew",
        "peak_stage_activations",
        "peak_activation_units",
        "peak_activation_bytes",
        "comm_ops",
    ):
        assert key in d
    json.dumps(d)
    ev = r.to_events("run1", "1f1b", time_unit_ns=1000, step=2)
    assert list(ev.columns) == list(EVENT_COLUMNS)
    assert set(ev["source"]) == {"simulated"} and set(ev["impl"]) == {"vpipe"}
    assert (ev["step"] == 2).all()
    assert len(ev) == len(r.timeline)
    row = ev[ev["name"] == "1F0"].iloc[0]
    assert (row["start_ns"], row["end_ns"]) == (1_500, 2_500)
    path = tmp_path / "t.json"
    trace = r.to_chrome_trace(path)
    loaded = json.loads(path.read_text())
    assert loaded["traceEvents"] == json.loads(json.dumps(trace["traceEvents"]))
    xs = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1, 2}
    assert len(xs) == 3 * 4 * 2
    b = [e for e in loaded["traceEvents"] if e["ph"] == "b"]
    assert len(b) == sum(r.comm_ops)


def test_cost_model_parse():
    c = CostModel.parse("f=1,b=2,w=0.5,comm=0.25")
    assert (c.f, c.b, c.w, c.comm_latency) == (1, 2, 0.5, 0.25)
    c = CostModel.parse(" f=2 , bw=100, bytes=50 ")
    assert c.boundary_costs(3).tolist() == [0.5, 0.5]
    assert CostModel.parse("") == CostModel(unit="rank")  # cost strings: per rank share


@pytest.mark.parametrize(
    "text,needle",
    [
        ("f=1,x=2", "bad cost item 'x=2'"),
        ("f", "bad cost item 'f'"),
        ("f=abc", "not a number"),
        ("f=-1", "f must be a finite number >= 0"),
        ("bw=0", "comm_bandwidth must be a positive number"),
        ("b=nan", "b must be"),
    ],
)
def test_cost_model_parse_errors(text, needle):
    with pytest.raises(CostModelError) as err:
        CostModel.parse(text)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_cost_model_per_stage_errors():
    with pytest.raises(CostModelError, match="unknown key 'x'"):
        CostModel(per_stage={0: {"x": 1.0}})
    with pytest.raises(CostModelError, match="outside 0..1"):
        simulate(one_f_one_b(2, 1), CostModel(per_stage={5: {"f": 1.0}}))
    with pytest.raises(CostModelError, match="activation_bytes has 1 entries, expected 2"):
        simulate(one_f_one_b(2, 1), CostModel(activation_bytes=[1.0]))


def test_simulate_rejects_invalid_and_deadlocked():
    s = Schedule(
        2,
        2,
        2,
        loop_placement(2, 2),
        actions_from_strings([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]),
    )
    with pytest.raises(VpipeError, match="deadlock: rank 0, position"):
        simulate(s)
    bad = one_f_one_b(2, 2)
    bad.actions[0].append(Action(0, W, 0))
    with pytest.raises(VpipeError, match="rank 0, position 4, action 0W0"):
        simulate(bad)


def _late_second_input() -> Schedule:
    """V placement on 2 ranks (stages 0, 3 on rank 0; 1, 2 on rank 1). Rank 0's overlap
    (3F1;0B0) takes 3F1's input from 2F1 and 0B0's gradient from 1B0, both on rank 1; the
    gradient comes two time units after the activation."""
    rows = [
        ["0F0", "0F1", "3F0", "3B0", "(3F1;0B0)OVERLAP_F_B", "3B1", "0B1"],
        ["1F0", "2F0", "1F1", "2F1", "2B0", "1B0", "2B1", "1B1"],
    ]
    return Schedule(2, 4, 2, v_placement(2), actions_from_strings(rows))


@pytest.mark.parametrize("lowered", [False, True])
def test_overlap_parts_wait_for_their_own_inputs(lowered):
    # Unit costs (w=0: B costs 1), no comm cost. Rank 0: 0F0 [0,1], 0F1 [1,2]; rank 1: 1F0
    # [1,2], 2F0 [2,3], 1F1 [3,4], 2F1 [4,5]; rank 0: 3F0 [3,4], 3B0 [4,5]. The overlap's
    # 3F1 runs as soon as 2F1's output is there: [5,6]; 0B0 waits for 1B0 (rank 1: 2B0 [5,6],
    # 1B0 [6,7]): [7,8]. Under all-inputs-first semantics 3F1 would start at 7.
    s = _late_second_input()
    if lowered:
        s = lower(s)
    r = simulate(s, CostModel(f=1, b=1, w=0))
    tl = r.timeline.set_index("name")
    assert (tl.loc["3F1", "start"], tl.loc["3F1", "end"]) == (5, 6)
    assert (tl.loc["0B0", "start"], tl.loc["0B0", "end"]) == (7, 8)
    # 3B1 [8,9]; 2B1 [9,10], 1B1 [10,11] on rank 1; 0B1 [11,12].
    assert tl.loc["0B1", "end"] == r.makespan == 12
    assert r.busy == [8, 8]


def test_posting_and_gap_overheads_are_charged_where_the_program_has_them():
    """1f1b P=2 M=2 lowered: rank 0 runs F0 SEND_F0 RECV_B0 F1 SEND_F1 RECV_B1 B0 B1, rank 1
    RECV_F0 F0 RECV_F1 B0 SEND_B0 F1 B1 SEND_B1. Each compute action costs a gap before it,
    each SEND/RECV post + gap; they delay the rank but are not busy time."""
    from vpipe.sim import CostModel, simulate

    s = make_schedule("1f1b", 2, 2)
    plain = simulate(s, CostModel.parse("f=1,b=1,w=1"))
    r = simulate(s, CostModel.parse("f=1,b=1,w=1,post=0.1,gap=0.01"))
    # rank 1: F0 at max(.12, 1.01) -> 2.01; B0 at 2.13 -> 4.13; F1 at 4.25 -> 5.25;
    # B1 at 5.26 -> 7.26; then SEND_B1 to 7.37. rank 0: B0 waits for 4.13 -> 6.13; B1 for
    # 7.26 -> 9.26.
    assert plain.makespan == 9.0
    assert r.makespan == pytest.approx(9.26)
    assert r.busy == plain.busy == [6.0, 6.0]
    assert simulate(lower(s), CostModel.parse("f=1,b=1,w=1,post=0.1,gap=0.01")).makespan == (
        pytest.approx(9.26)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_schedule("interleaved-1f1b", 4, 8, 2),
        lambda: make_schedule("dualpipev", 4, 8),  # overlap actions: parts of their own
        lambda: lower(make_schedule("zbv", 3, 6)),
    ],
)
def test_a_prepared_schedule_simulates_as_a_fresh_one(make):
    """The first simulation of a prepared schedule replays it rank by rank and keeps the order
    its parts ran in; the next ones replay in that order: the same figures to the bit."""
    from vpipe.sim.simulator import prepare

    s = make()
    prep = prepare(s)
    S = s.n_stages
    for costs in (
        CostModel(f=1, b=2, w=1, comm_latency=0.5, activation_bytes=[1] * S),
        CostModel(f=2, b=3, w=1, post=0.1, comm_handshake=0.2, overlap=0.8),
        CostModel(f=1.5, b=2.5, w=0.7, comm_bandwidth=3.0, comm_bytes=2.0, gap=0.05),
    ):
        fresh, kept = simulate(s, costs), simulate(s, costs, prepared=prep)
        assert kept.to_dict() == fresh.to_dict()
        assert {k: v.tolist() for k, v in kept.columns.items()} == {
            k: v.tolist() for k, v in fresh.columns.items()
        }
        compute = kept.columns["kind"] < 4
        assert {k: v.tolist() for k, v in kept.compute_columns.items()} == {
            k: v[compute].tolist() for k, v in kept.columns.items()
        }
    assert prep.prog.order is not None
    kept.columns["start"][:] = -1.0  # a caller's own columns: the next ones are untouched
    assert simulate(s, costs, prepared=prep).columns["start"].min() >= 0
    with pytest.raises(ValueError, match="another schedule"):
        simulate(make(), costs, prepared=prep)
