"""Pipeline x data parallel on gloo: P=2 pipeline ranks x DP=2 replicas (4 processes, one
launch for every schedule family), gradients against one process's unpipelined step on the
whole global batch; the reductions' spans with their stage; bad layouts refused up front."""

from __future__ import annotations

import pytest
import torch

from vpipe.ir.reduction import format_reduce, gradient_points, parse_reduce
from vpipe.ir.schedule import parse_action
from vpipe.runtime.data_parallel import DataParallelError, buckets_of, check_layout
from vpipe.runtime.launch import spawn
from vpipe.schedules import make_schedule, schedule_names
from vpipe.sweep.harness import RankSpec, build

P, DP, M = 2, 2, 4
SIZES = {"d_model": 16, "d_hidden": 32}
BUCKET_BYTES = 2048  # several buckets per stage: 16x32 floats is one


def _every_family(rank: int, world: int, specs: list[RankSpec], out_dir: str) -> dict:
    """Per family: this rank's reference findings after two accumulated steps, and its
    reductions; and the reduction rows of the event table of one profiled zbv step."""
    findings = {}
    for spec in specs:
        h = build(spec, rank)
        h.zero_grad()
        h.pipe.step(h.inputs, h.targets)  # gradients accumulate: two steps = twice the gradient
        losses = h.pipe.step(h.inputs, h.targets)
        for p in h.params:
            p.grad /= 2
        findings[spec.schedule.name] = (h.check(losses, 1e-5), h.stats["reductions"])
    h = build(specs[[s.schedule.name for s in specs].index("zbv")], rank)
    events = h.profiled_step(out_dir, {"run_id": "dp", "impl": "vpipe", "schedule": "zbv"})
    reduce_rows = events[events["name"].astype(str).str.contains("REDUCE")]
    rows = reduce_rows[["kind", "stage", "microbatch", "start_ns", "end_ns"]].astype({"kind": str})
    return {"findings": findings, "rows": rows.to_dict("records"), "stages": h.stages}


def test_every_family_p2_dp2_matches_the_global_batch_reference(tmp_path):
    specs = [
        RankSpec(
            make_schedule(name, P, M),
            model="mlp",
            sizes=SIZES,
            batch=DP * M * 2,
            dp=DP,
            dp_bucket_bytes=BUCKET_BYTES,
        )
        for name in schedule_names()
    ]
    results = spawn(_every_family, P * DP, specs, str(tmp_path), timeout_s=300)
    for rank, r in enumerate(results):
        for name, (findings, reductions) in r["findings"].items():
            bad = [f for f in findings if not f["ok"]]
            assert findings and not bad, (rank, name, bad)
            stages = set(make_schedule(name, P, M).stages_of(rank % P))
            assert {x["stage"] for x in reductions} == stages, (rank, name)
            assert all(x["end_ns"] >= x["start_ns"] > 0 for x in reductions)
        # the event table: each stage's buckets, a REDUCE row (start to completion) and a WAIT
        # row (the step's end waiting for it) each, with the stage and the bucket
        rows = r["rows"]
        reduced = [(x["stage"], x["microbatch"]) for x in rows if x["kind"] == "REDUCE"]
        waited = [(x["stage"], x["microbatch"]) for x in rows if x["kind"] == "WAIT"]
        assert sorted(reduced) == sorted(waited) and len(set(reduced)) == len(reduced)
        assert (
            {s for s, _ in reduced}
            == set(r["stages"])
            == set(make_schedule("zbv", P, M).stages_of(rank % P))
        )
        assert max(b for _, b in reduced) > 0  # several buckets per stage
        assert all(x["end_ns"] >= x["start_ns"] for x in rows)


def test_reduction_names_are_strict_and_not_schedule_actions():
    assert format_reduce(3, 1) == "3REDUCE1"
    assert parse_reduce("3REDUCE1") == (3, 1)
    assert parse_reduce("3REDUCE") is None and parse_reduce("3REDUCE1x") is None
    with pytest.raises(ValueError):
        parse_action("0REDUCE0")  # a schedule CSV cannot hold one


def test_gradient_points_follow_the_last_weight_gradient():
    zbv = make_schedule("zbv", 2, 4)
    for rank in range(2):
        program = zbv.actions[rank]
        points = gradient_points(program, zbv.stages_of(rank))
        for i, stages in points.items():
            for s in stages:
                later = [p for a in program[i + 1 :] for p in a.compute_parts() if p.stage == s]
                assert all(p.kind.value in "FI" for p in later)
                assert any(
                    p.stage == s and p.kind.value in "WB" for p in program[i].compute_parts()
                )


def test_buckets_cut_in_order():
    layer = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    buckets = buckets_of(list(layer.parameters()), 2048)
    assert [len(b) for b in buckets] == [1, 2, 1]  # 2048 B weight; bias+weight; bias
    assert len(buckets_of(list(layer.parameters()), 10**9)) == 1


@pytest.mark.parametrize(
    "world, backend, device, fsdp, says",
    [
        (3, "gloo", "cpu", False, "world size 3 is not pipeline ranks x replicas = 2 x 2 = 4"),
        (4, "nccl", "cpu", False, "cannot reduce cpu gradients on nccl"),
        (4, "mpi", "cpu", False, "cannot reduce on backend 'mpi'"),
        (4, "gloo", "cpu", True, "gloo has no reduce_scatter_tensor"),
    ],
)
def test_bad_layouts_say_what_is_wrong(world, backend, device, fsdp, says):
    with pytest.raises(DataParallelError, match=says) as e:
        check_layout(world, P, DP, backend, device, fsdp)
    assert "\n" not in str(e.value)


def test_spec_check_refuses_a_batch_that_does_not_shard():
    spec = RankSpec(make_schedule("1f1b", P, M), sizes=SIZES, batch=M * 3, dp=DP)
    with pytest.raises(Exception, match="does not split into 2 replicas x 4 equal microbatches"):
        spec.check(build=False)


class _FakeEvent:
    """A stand-in for torch.cuda.Event: its record() notes the host's clock."""

    def record(self) -> None:
        import time

        self.t = time.perf_counter_ns()

    def elapsed_time(self, other: _FakeEvent) -> float:
        return (other.t - self.t) / 1e6  # milliseconds, as CUDA's

    def synchronize(self) -> None:
        pass


def test_reductions_on_a_gpu_are_timed_by_events_not_by_their_enqueue():
    """With CUDA events (a stand-in here) the records are on the device clock and the step's
    wait is the events' (NCCL's future completes at enqueue, so host times would read 0)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from vpipe.runtime.data_parallel import GradientReducer

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mods = {0: nn.Linear(4, 4), 1: nn.Linear(4, 2)}
        for m in mods.values():
            m(torch.ones(1, 4)).sum().backward()
        r = GradientReducer(mods, dist.group.WORLD, bucket_bytes=64, event=_FakeEvent)
        r.start(0)
        r.start(1)
        records = r.finish()
    finally:
        if own:
            dist.destroy_process_group()
    assert len(records) >= 2 and {x["clock"] for x in records} == {"device"}
    assert all(x["end_ns"] >= x["start_ns"] for x in records)
    assert r.device_wait_s is not None and r.device_wait_s >= 0


def test_packing_a_bucket_is_the_reductions_work_not_the_actions():
    """The concatenation of a bucket's gradients runs inside its REDUCE span: a profiled
    trace charges it to the reduction, not to the W or B that completed the gradients."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, record_function

    from vpipe.runtime.data_parallel import GradientReducer

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mods = {0: nn.Linear(4, 4)}
        mods[0](torch.ones(1, 4)).sum().backward()
        r = GradientReducer(mods, dist.group.WORLD, bucket_bytes=1 << 20)
        r.profiling = True
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("PP:0W0"):
                r.start(0)
            r.finish()
    finally:
        if own:
            dist.destroy_process_group()
    ev = prof.events()
    reduce = [e for e in ev if e.name == "PP:0REDUCE0"]
    cats = [e for e in ev if e.name == "aten::cat"]
    assert len(reduce) == 1 and cats
    span = reduce[0].time_range
    for c in cats:
        assert span.start <= c.time_range.start and c.time_range.end <= span.end, (span, c)
