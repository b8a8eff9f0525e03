"""Calibration: recover costs from a run's events and predict other schedules."""

import pytest

from vpipe.events import events_frame
from vpipe.predict.calibrate import anchor, calibrate, fidelity_table, predict
from vpipe.predict.links import comm_link_us
from vpipe.predict.pieces import split_sizes
from vpipe.schedules import make_schedule
from vpipe.sim import CostModel, simulate

# per MLP block, microseconds: F, I, W
F, I, W = 10.0, 8.0, 6.0


def block_costs(n_stages, n_units=4):
    """True costs; stage 0 computes no input gradient, so its backward is all W."""
    sizes = split_sizes(n_units, n_stages)
    return CostModel(
        per_stage={
            s: {"f": F * n, "b": I * n if s else 0.0, "w": W * n if s else (I + W) * n}
            for s, n in enumerate(sizes)
        }
    )


def test_round_trip_through_the_simulator():
    """Calibrated on simulated 1f1b (2 stages of 2 blocks), the prediction of zbv and
    interleaved-1f1b (4 stages of 1 block) equals simulating them with the true costs."""
    one = make_schedule("1f1b", 2, 4)
    ev = simulate(one, block_costs(2)).to_events("cal", one, time_unit_ns=1000)
    cal = calibrate(ev, w_share=W / (I + W))
    assert cal.f.tolist() == pytest.approx([20, 20]) and cal.post == cal.gap == 0
    assert cal.b.tolist() == pytest.approx([0, 16]) and cal.w.tolist() == pytest.approx([28, 12])
    for name in ("zbv", "interleaved-1f1b"):
        sched = make_schedule(name, 2, 4)
        truth = simulate(sched, block_costs(4)).makespan
        assert predict(cal, sched, n_units=4).makespan == pytest.approx(truth)
    # with measured I and W (zb-h1) no split is assumed
    zb = make_schedule("zb-h1", 2, 4)
    cal2 = calibrate(simulate(zb, block_costs(2)).to_events("zb", zb))
    assert cal2.w_share is None and cal2.w.tolist() == pytest.approx([28, 12])
    assert cal2.share_of_w() == pytest.approx(W / (I + W))
    truth = simulate(make_schedule("zbv", 2, 4), block_costs(4)).makespan
    assert predict(cal2, make_schedule("zbv", 2, 4), n_units=4).makespan == pytest.approx(truth)
    zbv = make_schedule("zbv", 2, 4)
    truth_ev = simulate(zbv, block_costs(4)).to_events("zbv", zbv)
    table = fidelity_table(cal, [("zbv", zbv, truth_ev, None)], 4, ev, w_share=W / (I + W))
    assert table.loc[0, "predicted_step_ms"] == pytest.approx(
        simulate(zbv, block_costs(4)).makespan / 1e3
    )
    assert table.loc[0, "error"] == pytest.approx(0, abs=1e-9)
    assert table.loc[0, "paired_error"] == pytest.approx(0, abs=1e-9) and table.loc[0, "pairs"] == 1


def row(rank, kind, name, start, end, stage=0, mb=0):
    return dict(run_id="m", source="measured", impl="vpipe", schedule="1f1b", rank=rank, step=0,
                stage=stage, microbatch=mb, kind=kind, name=name, start_ns=start * 1000,
                end_ns=end * 1000)  # fmt: skip


def test_comm_latency_and_overhead_from_measured_spans():
    ev = events_frame(
        [
            row(0, "other", "STEP", 0, 100, -1, -1),
            row(0, "F", "0F0", 0, 30),
            row(0, "SEND_F", "0SEND_F0", 32, 34),
            row(0, "WAIT", "WAIT:0RECV_B0", 40, 80),
            row(0, "B", "0B0", 80, 96),
            row(1, "other", "STEP", 0, 100, -1, -1),
            row(1, "WAIT", "WAIT:1RECV_F0", 0, 44, stage=1),  # send ended at 34: 10 us
            row(1, "F", "1F0", 46, 60, stage=1),
            row(1, "B", "1B0", 60, 76, stage=1),
            row(1, "SEND_B", "1SEND_B0", 77, 78, stage=1),  # wait ended at 80: 2 us
        ]
    )
    assert comm_link_us(ev) == pytest.approx((6.0, 0.0))  # median of 10 and 2; no RECV spans
    cal = calibrate(ev)
    assert cal.post == pytest.approx(1.5)  # mean of SEND_F 2 us and SEND_B 1 us
    # uncovered time / actions: rank 0: 100 - (30 + 2 + 40 + 16) = 12 over 3 actions = 4;
    # rank 1: 100 - (44 + 14 + 16 + 1) = 25 over 3
    assert cal.gap == pytest.approx((12 + 25) / 6)
    assert cal.f.tolist() == [30, 14] and cal.w_share == 0.5
    assert cal.b.tolist() == [0, 8] and cal.w.tolist() == [16, 8]
    # the cost model keeps compute as measured and charges posts and gaps where the program
    # has them: rank 0 runs 0RECV_B0 0F0 0SEND_F0 0B0, rank 1 1RECV_F0 1F0 1B0 1SEND_B0
    sched = make_schedule("1f1b", 2, 1)
    cm = cal.cost_model(sched)
    assert cm.per_stage[0]["f"] == 30 and cm.per_stage[1]["b"] == 8 and cm.per_stage[1]["w"] == 8
    assert (cm.post, cm.gap) == (cal.post, cal.gap)
    g, pg, lat = cal.gap, cal.post + cal.gap, cm.comm_latency
    r0_f0_end = pg + g + 30  # RECV_B0 posted, then 0F0
    r1_f0 = max(pg + g, r0_f0_end + lat)  # RECV_F0 posted, then wait for 0F0's output
    r1_b0_end = r1_f0 + 14 + g + 16  # 1F0, then 1B0 (I 8 + W 8)
    r0_b0 = max(r0_f0_end + pg + g, r1_b0_end + lat)  # SEND_F0 posted, then wait for 1B0's
    want = max(r0_b0 + 16, r1_b0_end + pg)  # rank 1 ends posting 1SEND_B0
    assert simulate(sched, cm).makespan == pytest.approx(want)


def test_handshake_from_receives_posted_after_their_send():
    """Early receive F0: latency 4 us from the send's end. Late receives (posted after the
    send began): F1, F3 and F4 blocked, 69, 109 and 149 us from their post; F2's and F5's
    waits did not block, so their messages took at most 9 us (wait start - post). Their
    median, 69, less the latency is the handshake; the censored F2 and F5 still count
    (without them the median would be 109). With two blocked late waits, no handshake: one
    or two slowed waits would set it alone."""
    rows = [
        row(0, "SEND_F", "0SEND_F0", 10, 11),
        row(1, "RECV_F", "1RECV_F0", 0, 1, stage=1),
        row(1, "WAIT", "WAIT:1RECV_F0", 2, 15, stage=1),
    ]
    for mb, (send, recv, wait) in enumerate(
        [
            ((20, 21), (30, 31), (40, 100)),
            ((50, 51), (60, 61), (70, 71)),
            ((80, 81), (90, 91), (95, 200)),
            ((110, 111), (120, 121), (125, 270)),
            ((300, 301), (310, 311), (320, 321)),
        ],
        start=1,
    ):
        rows += [
            row(0, "SEND_F", f"0SEND_F{mb}", *send, mb=mb),
            row(1, "RECV_F", f"1RECV_F{mb}", *recv, stage=1, mb=mb),
            row(1, "WAIT", f"WAIT:1RECV_F{mb}", *wait, stage=1, mb=mb),
        ]
    assert comm_link_us(events_frame(rows)) == pytest.approx((4.0, 65.0))
    # without the early receive there is nothing to split: one latency, no handshake
    assert comm_link_us(events_frame(rows[3:])) == pytest.approx((69.0, 0.0))
    # F1 and F3 alone blocked: too few to read a handshake from
    assert comm_link_us(events_frame(rows[:12])) == pytest.approx((4.0, 0.0))


def test_leave_one_out_is_exact_on_traces_with_known_costs():
    """Traces simulated with known per-piece costs (a model of 4 equal pieces; stage 0 has no
    input gradient, as on a real first stage): calibrating on any schedule predicts every
    other one exactly, in and out of sample."""
    from vpipe.predict.leave_one_out import Case, leave_one_out
    from vpipe.sim import CostModel

    def true_costs(n_stages: int) -> CostModel:
        k = 4 // n_stages  # pieces per stage; per piece F 300 us, I 200, W 200
        per_stage = {s: {"f": 300.0 * k, "b": 200.0 * k, "w": 200.0 * k} for s in range(n_stages)}
        per_stage[0] = {"f": 300.0 * k, "b": 0.0, "w": 400.0 * k}
        return CostModel(per_stage=per_stage)  # simulated traces have no WAIT: no comm figure

    cases = []
    for name in ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"):
        s = make_schedule(name, 2, 4)
        sim = simulate(s, true_costs(s.n_stages))
        events = sim.to_events(f"t-{name}", s, time_unit_ns=1000)
        cases.append(Case(name, s, events, sim.makespan * 1e-6))
    table = leave_one_out(cases, n_units=4).set_index("calibrated on")
    assert list(table.index) == list(table.columns)
    assert (table.abs() < 1e-9).all().all(), table
    # and it can fail: a wrong timed median shows up as that column's error, and the config
    # anchored to it (its own row) predicts every other one 10% high
    cases[3].timed_s *= 1.1
    bad = leave_one_out(cases, n_units=4).set_index("calibrated on")
    assert bad["zbv"].drop("zbv").round(4).eq(round(1 / 1.1 - 1, 4)).all()
    assert bad.loc["zbv"].drop("zbv").round(3).eq(0.1).all() and abs(bad.loc["zbv", "zbv"]) < 1e-3
    # unanchored, the row keeps its profiled level: only the wrong column errs
    plain = leave_one_out(cases, n_units=4, anchored=False).set_index("calibrated on")
    assert plain["zbv"].round(4).eq(round(1 / 1.1 - 1, 4)).all()
    assert (plain.drop(columns="zbv").abs() < 1e-9).all().all()


def test_overlap_factor_from_measured_compound_spans():
    """A compound's span (its parts' rows carry it) over the sum of its parts' separate costs:
    the simulator then charges overlap parts that fraction."""
    comp = "(0F1;1B0)OVERLAP_F_B"
    ev = events_frame(
        [
            row(0, "F", "0F0", 0, 10),
            row(0, "F", "1F1", 10, 20, stage=1, mb=1),
            row(0, "B", "1B1", 20, 40, stage=1, mb=1),
            row(0, "F", comp, 40, 64, mb=1),  # 24 us for F 10 + B 20
            row(0, "B", comp, 40, 64, stage=1, mb=0),
            row(0, "B", "0B0", 64, 84),
            row(0, "B", "0B1", 84, 104, mb=1),
        ]
    )
    cal = calibrate(ev)
    assert cal.overlap == pytest.approx(24 / 30)
    assert cal.cost_model(make_schedule("dualpipev", 1, 2)).overlap == pytest.approx(0.8)
    assert calibrate(ev[~ev["name"].astype(str).str.startswith("(")]).overlap == 1.0
    s = make_schedule("dualpipev", 2, 8)
    plain, faster = (simulate(s, CostModel(overlap=x)) for x in (1.0, 0.8))
    assert faster.makespan < plain.makespan and sum(faster.busy) < sum(plain.busy)
    assert simulate(make_schedule("zbv", 2, 8), CostModel(overlap=0.5)).makespan == (
        simulate(make_schedule("zbv", 2, 8), CostModel()).makespan
    )  # no overlap actions: nothing changes


def test_data_parallel_reductions_are_not_pipeline_costs():
    """A --dp run's REDUCE span and the step end's WAIT for it (named like the action
    grammar, stage 0 bucket 0) change no pipeline cost; the wait counts as covered time."""
    base = [
        row(0, "other", "STEP", 0, 160, -1, -1),
        row(0, "F", "0F0", 0, 30),
        row(0, "SEND_F", "0SEND_F0", 32, 34),
        row(0, "WAIT", "WAIT:0RECV_B0", 40, 80),
        row(0, "B", "0B0", 80, 96),
        row(1, "other", "STEP", 0, 100, -1, -1),
        row(1, "WAIT", "WAIT:1RECV_F0", 0, 44, stage=1),
        row(1, "F", "1F0", 46, 60, stage=1),
        row(1, "B", "1B0", 60, 76, stage=1),
        row(1, "SEND_B", "1SEND_B0", 77, 78, stage=1),
    ]
    reduced = [
        *base,
        row(0, "REDUCE", "0REDUCE0", 96, 150),
        row(0, "WAIT", "WAIT:0REDUCE0", 97, 160),
    ]
    plain, dp = calibrate(events_frame(base)), calibrate(events_frame(reduced))
    assert dp.comm_latency == plain.comm_latency == pytest.approx(6.0)
    assert dp.post == plain.post and dp.w_share == plain.w_share
    for costs in ("f", "b", "w"):
        assert getattr(dp, costs).tolist() == getattr(plain, costs).tolist()
    # rank 0's uncovered time: 72 us, less the 63 us of the step end's wait
    assert plain.gap == pytest.approx((72 + 25) / 6) and dp.gap == pytest.approx((9 + 25) / 6)


def test_a_full_backward_beside_i_and_w_keeps_its_own_cost():
    """A run with B on a stage that also ran I and W (dualpipev's overlapped B): B costs what
    it measured, not I + W, for the same split; the simulator uses it."""
    from vpipe import simulate
    from vpipe.schedules import make_schedule
    from vpipe.sim import CostModel

    sched = make_schedule("dualpipev", 2, 8)
    per_stage = {s: {"f": 4.0, "b": 3.0, "w": 2.0, "B": 7.0} for s in range(4)}
    ev = simulate(sched, CostModel(per_stage=per_stage)).to_events("m", sched, time_unit_ns=1000)
    cal = calibrate(ev)
    assert list(cal.full_b) == [7.0] * 4 and list(cal.b + cal.w) == [5.0] * 4
    model = cal.cost_model(sched)
    assert list(model.backward_times(4)) == [7.0] * 4
    assert simulate(sched, model).makespan == simulate(sched, CostModel(per_stage=per_stage)).makespan


def test_a_short_wait_long_after_its_message_could_move_is_no_handshake():
    """Receives posted after their send whose waits found the data there: on a busy host such
    a wait takes up to a few hundred us of the executor's own work, not the message's time
    since it could move (tens of ms here). Their waits are censored, not blocked: no
    handshake (it read 20 ms before, from 120 us waits)."""
    rows = [
        row(0, "SEND_F", "0SEND_F0", 10, 11),
        row(1, "RECV_F", "1RECV_F0", 0, 1, stage=1),
        row(1, "WAIT", "WAIT:1RECV_F0", 2, 15, stage=1),  # early: 4 us latency
    ]
    for mb, took in enumerate([30, 60, 120, 45, 110, 80, 40], start=1):
        t = mb * 100_000
        rows += [
            row(0, "SEND_F", f"0SEND_F{mb}", t, t + 1, mb=mb),
            row(1, "RECV_F", f"1RECV_F{mb}", t + 10, t + 11, stage=1, mb=mb),
            row(1, "WAIT", f"WAIT:1RECV_F{mb}", t + 20_000, t + 20_000 + took, stage=1, mb=mb),
        ]
    assert comm_link_us(events_frame(rows)) == pytest.approx((4.0, 0.0))
    # waits that did block (50 ms, beyond twice the slowest of those) count; one among many
    # that did not says nothing of the typical message, so it needs to be most of them
    for mb in range(8, 16):
        t = mb * 100_000
        rows += [
            row(0, "SEND_F", f"0SEND_F{mb}", t, t + 1, mb=mb),
            row(1, "RECV_F", f"1RECV_F{mb}", t + 10, t + 11, stage=1, mb=mb),
            row(1, "WAIT", f"WAIT:1RECV_F{mb}", t + 20, t + 50_011, stage=1, mb=mb),
        ]
        if mb == 8:
            assert comm_link_us(events_frame(rows)) == pytest.approx((4.0, 0.0))
    assert comm_link_us(events_frame(rows)) == pytest.approx((4.0, 50_000 - 4.0))


def test_anchor_scales_compute_so_the_calibrated_config_predicts_its_timed_median():
    """Profiled steps at one level, a timed median 20% slower: the anchor scales compute (not
    posting or gaps) until the calibrated config itself predicts the timed median; without a
    timed median nothing changes; every other prediction moves with it."""
    one = make_schedule("1f1b", 2, 4)
    ev = simulate(one, block_costs(2)).to_events("cal", one, time_unit_ns=1000)
    cal = calibrate(ev)
    own = predict(cal, one).makespan  # microseconds
    timed = own * 1.2 * 1e-6
    anchored = anchor(cal, one, timed)
    assert predict(anchored, one).makespan == pytest.approx(own * 1.2, rel=1e-3)
    assert anchored.compute_scale == pytest.approx(1.2, rel=1e-3)  # no overheads: exactly 1.2
    assert anchor(cal, one, None) is cal and anchor(cal, one, float("nan")) is cal
    zbv = make_schedule("zbv", 2, 4)
    assert predict(anchored, zbv, 4).makespan == pytest.approx(
        1.2 * predict(cal, zbv, 4).makespan, rel=1e-3
    )
    # with overheads (which the anchor leaves alone) the scale is larger than the ratio
    from dataclasses import replace

    slow = replace(cal, post=5.0, gap=3.0)
    made = predict(slow, one).makespan
    a = anchor(slow, one, made * 1.2e-6)
    assert predict(a, one).makespan == pytest.approx(made * 1.2, rel=1e-3)
    assert a.compute_scale > 1.2 and (a.post, a.gap) == (5.0, 3.0)


def test_breakdown_names_what_each_term_adds():
    from dataclasses import replace

    from vpipe.predict.error_terms import breakdown

    one = make_schedule("1f1b", 2, 4)
    cal = calibrate(simulate(one, block_costs(2)).to_events("cal", one, time_unit_ns=1000))
    cal = replace(cal, post=5.0, gap=0.0, comm_latency=2.0, compute_scale=1.1)
    zbv = make_schedule("zbv", 2, 4)
    t = breakdown(cal, [("1f1b", one, None), ("zbv", zbv, 1e-3)], 4).set_index("schedule")
    assert t.loc["zbv", "predicted ms"] == pytest.approx(predict(cal, zbv, 4).makespan / 1e3)
    assert t.loc["zbv", "error"] == pytest.approx(t.loc["zbv", "predicted ms"] / 1.0 - 1)
    assert (t["gaps"] == 0).all() and (t["posting"] > 0).all() and (t["link"] > 0).all()
    unscaled = predict(replace(cal, compute_scale=1.0), one).makespan / 1e3
    assert t.loc["1f1b", "level"] == pytest.approx(t.loc["1f1b", "predicted ms"] - unscaled)
    assert t.loc["zbv", "restaged"] == "yes" and t.loc["1f1b", "restaged"] == ""
    assert "w_share" in t.columns  # 1f1b has only B: the split is assumed
    zb = make_schedule("zb-h1", 2, 4)
    measured = calibrate(simulate(zb, block_costs(2)).to_events("zb", zb, time_unit_ns=1000))
    assert "w_share" not in breakdown(measured, [("zb-h1", zb, None)], 4).columns
