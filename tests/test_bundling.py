"""Message bundling: which messages travel together, how they are packed, and that a bundled
run computes exactly what an unbundled one does."""

from dataclasses import replace

import pytest
import torch

from vpipe.ir import Kind, ScheduleError
from vpipe.ir.bundling import comm_bundles
from vpipe.ir.lowering import lower
from vpipe.runtime.launch import spawn
from vpipe.runtime.packing import WaitOnce, pack, packed_buffer
from vpipe.schedules import make_schedule, schedule_names
from vpipe.sweep.harness import RankSpec, build

_SEND = {Kind.SEND_F, Kind.SEND_B}


def _message(a):
    """(direction, boundary, microbatch) of a SEND or RECV."""
    if a.kind in (Kind.SEND_F, Kind.RECV_F):
        return 0, a.stage - (a.kind is Kind.RECV_F), a.microbatch
    return 1, a.stage - (a.kind is Kind.SEND_B), a.microbatch


def _peer(s, a):
    up = a.kind in (Kind.SEND_F, Kind.RECV_B)
    return s.placement[a.stage + (1 if up else -1)]


@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize("n_ranks", [2, 4])
def test_bundles_pair_up_one_batch_on_each_side(name, n_ranks):
    s = lower(make_schedule(name, n_ranks, 8))
    bundles = comm_bundles(s)
    sends, recvs = {}, {}
    for r, per_rank in enumerate(bundles):
        program = s.actions[r]
        seen = set()
        for b in per_rank:
            assert len(b) >= 2 and not seen & set(b)  # each action in one bundle at most
            seen |= set(b)
            idx = [program.index(a) for a in b]
            # one batch: only SEND/RECV actions between the first and the last member
            assert all(a.is_comm for a in program[idx[0] : idx[-1] + 1]), (r, b)
            assert idx == sorted(idx)
            assert len({_peer(s, a) for a in b}) == 1  # one peer per bundle
            kinds = {a.kind in _SEND for a in b}
            assert len(kinds) == 1
            (sends if kinds.pop() else recvs)[tuple(map(_message, b))] = r
    # every bundled send has its receive bundled the same way, in the same order
    assert set(sends) == set(recvs)


def test_dualpipev_bundles_its_overlap_sends_and_one_f_one_b_has_none():
    v = comm_bundles(lower(make_schedule("dualpipev", 2, 8)))
    assert all(len(per_rank) > 0 for per_rank in v)
    assert all(len(b) == 2 for per_rank in v for b in per_rank)
    assert comm_bundles(lower(make_schedule("1f1b", 2, 8))) == [[], []]


def test_bundling_needs_a_lowered_schedule_unless_every_stage_is_local():
    with pytest.raises(ScheduleError, match="lowered"):
        comm_bundles(make_schedule("dualpipev", 2, 4))
    assert comm_bundles(lower(make_schedule("dualpipev", 1, 4))) == [[]]  # nothing crosses


def test_packing_round_trips_mixed_dtypes_and_shapes():
    tensors = [
        torch.randn(3, 5),
        torch.arange(7, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.tensor(2.5, dtype=torch.float64),
        torch.randn(2, 3).to(torch.bfloat16),
        torch.empty(0, 4),
    ]
    packed = pack(tensors, torch.device("cpu"))
    assert packed.dtype == torch.uint8 and packed.numel() % 16 == 0
    buf, views = packed_buffer([(tuple(t.shape), t.dtype) for t in tensors], torch.device("cpu"))
    assert buf.numel() == packed.numel()
    buf.copy_(packed)  # what a receive does
    for t, v in zip(tensors, views, strict=True):
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t)
        assert v.data_ptr() % 16 == buf.data_ptr() % 16  # aligned within the buffer
        assert not v.requires_grad and v.is_leaf  # a stage may mark it requires_grad


def test_a_shared_work_is_waited_for_once():
    class Work:
        waits = 0

        def wait(self):
            Work.waits += 1
            if Work.waits > 1:
                raise AssertionError("a gloo work waited twice blocks forever")
            return True

        def is_completed(self):
            return Work.waits > 0

    once = WaitOnce(Work())
    assert not once.is_completed()
    once.wait()
    once.wait()
    assert once.is_completed() and Work.waits == 1


def _bundled_and_not(rank, n_ranks, spec):
    out = {}
    for bundle in (True, False):
        h = build(replace(spec, bundle_messages=bundle), rank)
        h.zero_grad()
        losses = h.step()
        grads = {
            f"{i}.{n}": p.grad.clone()
            for i in h.stages
            for n, p in h.model.stages[i].named_parameters()
        }
        out[bundle] = (None if losses is None else [float(x) for x in losses], grads)
        failures = h.check(losses, 1e-6)
        assert all(f["ok"] for f in failures), failures
    return out


@pytest.mark.parametrize("model", ["mlp", "tuple"])
def test_bundled_run_equals_unbundled_and_the_reference(model):
    spec = RankSpec(make_schedule("dualpipev", 2, 4), model=model, batch=8)
    for per_rank in spawn(_bundled_and_not, 2, spec, timeout_s=180):
        (loss_b, grads_b), (loss_u, grads_u) = per_rank[True], per_rank[False]
        assert loss_b == loss_u
        assert grads_b.keys() == grads_u.keys() and grads_b
        for k in grads_b:
            assert torch.equal(grads_b[k], grads_u[k]), k


@pytest.mark.parametrize("name", schedule_names())
def test_simulator_charges_post_once_per_bundle_planned_or_lowered(name):
    """``post`` is charged per posted operation: the vectorised plan of a compute-only schedule
    and the lowered program agree, and dualpipev's bundles make posting cheaper."""
    from vpipe.ir.bundling import posting_rows
    from vpipe.ir.flat import flatten
    from vpipe.sim import CostModel, simulate

    costs = CostModel(post=0.7, gap=0.1, comm_latency=0.3)
    s = make_schedule(name, 2, 8)
    assert simulate(s, costs).makespan == pytest.approx(simulate(lower(s), costs).makespan)
    posts = posting_rows(flatten(lower(s)))
    n_comm = sum(a.is_comm for acts in lower(s).actions for a in acts)
    assert len(posts) == n_comm
    bundled = n_comm - posts.sum()
    assert bundled == sum(len(b) - 1 for per_rank in comm_bundles(lower(s)) for b in per_rank)
    assert (bundled > 0) == (name == "dualpipev")


def test_calibration_charges_post_per_posted_operation(tmp_path):
    """A run's SEND/RECV spans add up to its posting time: calibrated per posted operation,
    so a dualpipev run (21 operations for 32 actions per rank) and the simulator agree."""
    from vpipe.ir.bundling import posting_rows
    from vpipe.ir.flat import flatten
    from vpipe.predict.calibrate import calibrate
    from vpipe.trace.kineto import convert
    from vpipe.trace.synth import write_synthetic_run

    s = lower(make_schedule("dualpipev", 2, 4))
    write_synthetic_run(tmp_path, s.actions, meta={"run_id": "v", "schedule": "dualpipev"})
    ev = convert([tmp_path]).events
    kind = ev["kind"].astype(str)
    comm = ev[kind.isin(["SEND_F", "RECV_F", "SEND_B", "RECV_B"])]
    spent_us = float((comm["end_ns"] - comm["start_ns"]).sum()) / 1e3
    posted = posting_rows(flatten(s)).sum()
    assert posted < len(comm)
    assert calibrate(ev).post == pytest.approx(spent_us / posted)


def test_runtime_knobs_benchmark_pairs_every_variant_with_the_default():
    from bench.runtime_knobs import VARIANTS, knob_ratios

    median, ratios = knob_ratios("dualpipev", "overhead-bound", 6)
    assert median > 0 and list(ratios) == [v for v in VARIANTS if v != "default"]
    for r in ratios.values():
        assert 1 <= r.n <= 6 and 0 < r.value < 10  # pairs, less any outlier pair
