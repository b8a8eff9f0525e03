"""Runtime correctness: every built-in schedule at P=1, 2 and 4 against the unpipelined model.

One process group per P runs every (schedule, M, model) config inside it; each config checks
per-microbatch losses and all gradients (float64), that a second step accumulates gradients,
and that a new batch shape re-infers the stage shapes.
"""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch

from vpipe.errors import PipelineError, ScheduleError
from vpipe.ir import Schedule, actions_from_strings, schedule_from_rows
from vpipe.ir.lowering import lower
from vpipe.models import build_model
from vpipe.runtime import Pipeline
from vpipe.runtime.launch import spawn
from vpipe.runtime.recompute import RECOMPUTABLE_SPAN
from vpipe.schedules import make_schedule, schedule_names
from vpipe.sweep.harness import reference_step

SIZES = {
    "mlp": {"d_model": 16, "d_hidden": 32},
    "gpt": {"vocab": 32, "d_model": 16, "n_heads": 2, "seq_len": 8},
    "tuple": {"d_model": 8, "d_hidden": 16},
}


def _float64(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def _batch(bm, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = bm.make_batch(batch, seed=seed)
    return _float64(x), _float64(y)


def _build(model: str, n_stages: int):
    bm = build_model(model, n_stages, seed=1, **SIZES[model])
    for m in bm.stages:
        m.double()
    return bm


def reference_steps(
    n_stages: int, n_mb: int, model: str, new_shape: bool, repeat: bool = True
) -> list:
    """The steps a config runs, with the unsplit model's per-microbatch losses and gradients
    (keyed ``(stage, name)``): (batch, seed, gradient factor, losses, grads) per step. With
    ``repeat`` a second step repeats the first, so gradients must have doubled; with
    ``new_shape`` a last step uses a new batch size (fresh gradients), which makes the pipeline
    re-infer its shapes."""
    bm = _build(model, n_stages)
    plan = [(2 * n_mb, 0)] + ([(3 * n_mb, 1)] if new_shape else [])
    out = []
    for batch, seed in plan:
        x, y = _batch(bm, batch, seed)
        ref = bm.reference_model()
        losses = reference_step(ref, bm.loss_fn, x, y, n_mb)
        grads = {
            (s, name): p.grad for s, m in enumerate(ref.stages) for name, p in m.named_parameters()
        }
        out.append((batch, seed, 1, losses, grads))
        if len(out) == 1 and repeat:
            out.append((batch, seed, 2, losses, grads))
    return out


def check_config(schedule: Schedule, model: str, rank: int, steps: list, **pipe_kw) -> dict:
    """Run ``steps`` (see reference_steps) of ``schedule`` on this rank and raise on any
    mismatch with the reference. Returns the last step's stats. ``pipe_kw`` go to Pipeline."""
    n_mb = schedule.n_microbatches
    bm = _build(model, schedule.n_stages)
    mine = schedule.stages_of(rank)
    pipe = Pipeline(schedule, {s: bm.stages[s] for s in mine}, bm.loss_fn, **pipe_kw)
    for step, (batch, seed, factor, ref_losses, ref_grads) in enumerate(steps):
        x, y = _batch(bm, batch, seed)
        if factor == 1:
            for m in bm.stages:
                m.zero_grad(set_to_none=True)
        losses = pipe.step(x if 0 in mine else None, y if schedule.loss_stage in mine else None)
        where = f"{schedule.name} P={schedule.n_ranks} M={n_mb} {model} step {step} rank {rank}"
        if schedule.loss_stage in mine:
            assert losses is not None and len(losses) == n_mb, where
            for m, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=0, msg=f"{where} mb {m}")
        else:
            assert losses is None, where
        for s in mine:
            for name, p in bm.stages[s].named_parameters():
                want = ref_grads[s, name] * factor
                torch.testing.assert_close(
                    p.grad, want, rtol=1e-9, atol=1e-12, msg=f"{where} grad {s}.{name}"
                )
        assert pipe._executor.leftovers() == 0, where
    return pipe.stats


def _jobs(n_ranks: int) -> list[tuple[Schedule, str, list]]:
    """Every schedule with every model, the microbatch count rotating so that each schedule
    and each model meets every count, plus schedules read from torch's CSV (compute-only and
    lowered). Each job carries its reference, computed once here rather than on every rank.
    Gradient accumulation and new batch shapes are exercised at P=1 and 2 for every schedule;
    at P=4 (four processes on a small machine) only by the CSV jobs, to keep the test short."""
    counts = {1: (1, 3, 4), 2: (2, 5, 3), 4: (4, 6, 5)}[n_ranks]
    scheds = []
    for i, name in enumerate(schedule_names()):
        for j, model in enumerate(SIZES):
            scheds.append((make_schedule(name, n_ranks, counts[(i + j) % 3]), model))
    base = make_schedule("zbv" if n_ranks > 1 else "interleaved-1f1b", n_ranks, 3)
    for text in (base.to_csv(), lower(base).to_csv()):
        scheds.append((Schedule.from_csv(text, name="from-csv"), "tuple"))
    jobs = []
    for k, (sched, model) in enumerate(scheds):
        extra = n_ranks < 4 or sched.name == "from-csv"
        steps = reference_steps(
            sched.n_stages, sched.n_microbatches, model, extra and k % 2 == 0, repeat=extra
        )
        jobs.append((sched, model, steps))
    return jobs


def run_jobs(rank: int, n_ranks: int, jobs: list) -> tuple[list[dict], list[str]]:
    """Worker (spawned, or in-process for P=1): every job on this rank; their last stats, and
    the span names of a profiled zbv step (not at P=4: the profiler's start-up is slow)."""
    stats = [check_config(sched, model, rank, steps) for sched, model, steps in jobs]
    return stats, profiled_spans(rank, n_ranks) if n_ranks != 4 else None


def profiled_spans(rank: int, n_ranks: int) -> list[str]:
    """The PP: span names recorded by torch.profiler over a pipeline's second step."""
    sched = make_schedule("zbv", n_ranks, 2)
    bm = _build("mlp", sched.n_stages)
    mine = sched.stages_of(rank)
    pipe = Pipeline(sched, {s: bm.stages[s] for s in mine}, bm.loss_fn)
    x, y = _batch(bm, 4, 0)
    args = (x if 0 in mine else None, y if sched.loss_stage in mine else None)
    pipe.step(*args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(*args)
    return sorted({e.name for e in prof.events() if e.name.startswith("PP:")})


def _check_results(results: list, n_ranks: int, n_jobs: int) -> None:
    assert len(results) == n_ranks
    sched = lower(make_schedule("zbv", n_ranks, 2))
    for rank, (per_rank, spans) in enumerate(results):
        assert len(per_rank) == n_jobs
        for stats in per_rank:
            assert stats["peak_live_activations"] >= 1
            assert stats["step_time_s"] > 0
        if spans is None:
            continue
        # One span per action, the step span (second step: k=1), and waits on receives.
        want = {f"PP:{a}" for a in sched.actions[rank]} | {"PP:STEP:1"}
        want |= {f"PP:WAIT:{a}" for a in sched.actions[rank] if a.kind.name.startswith("RECV")}
        want |= {RECOMPUTABLE_SPAN}  # the MLP's activation functions, marked for recomputation
        assert set(spans) == want, (rank, sorted(set(spans) ^ want))


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops on a shared 2-core machine run fastest on one thread (as spawned ranks do)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_schedule_single_rank_local_handoff():
    """P=1: every stage on one rank, all handoffs local, no process group at all."""
    jobs = _jobs(1)
    _check_results([run_jobs(0, 1, jobs)], 1, len(jobs))


@pytest.mark.parametrize("n_ranks", [2, 4])
def test_every_schedule_multi_rank(n_ranks):
    jobs = _jobs(n_ranks)
    _check_results(spawn(run_jobs, n_ranks, jobs, timeout_s=300), n_ranks, len(jobs))


class _CountBackward(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _CountBackward.calls += 1
        return g


class _Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 6)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(_CountBackward.apply(self.a(x))))


def test_split_backward_matches_b_without_recomputing_the_input_chain():
    from vpipe.runtime.backward import backward_full, backward_input, grad_node

    torch.manual_seed(0)
    mod = _Counted().double()
    params = list(mod.parameters())
    x = torch.randn(5, 6, dtype=torch.float64)
    g = torch.randn(5, 6, dtype=torch.float64)

    h = x.clone().requires_grad_(True)
    (gx_b,) = backward_full([mod(h)], [g], [h])
    grads_b = [p.grad.clone() for p in params]
    mod.zero_grad(set_to_none=True)

    h = x.clone().requires_grad_(True)
    _CountBackward.calls = 0
    (gx_i,), task = backward_input([mod(h)], [g], [h], {grad_node(p): p for p in params})
    assert _CountBackward.calls == 1 and all(p.grad is None for p in params)
    assert not task.recomputes and len(task.parts) == 2  # one per linear layer
    task.run()
    assert _CountBackward.calls == 1  # W did not run the chain below the second linear again
    torch.testing.assert_close(gx_i, gx_b, rtol=1e-12, atol=0)
    for p, want in zip(params, grads_b, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=0)


def test_split_backward_falls_back_for_a_weight_used_twice():
    from vpipe.runtime.backward import backward_full, backward_input, grad_node

    lin = torch.nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    g = torch.randn(3, 4, dtype=torch.float64)
    h = x.clone().requires_grad_(True)
    (gx_b,) = backward_full([lin(lin(h))], [g], [h])
    want = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    h = x.clone().requires_grad_(True)
    nodes = {grad_node(p): p for p in lin.parameters()}
    (gx_i,), task = backward_input([lin(lin(h))], [g], [h], nodes)
    task.run()
    torch.testing.assert_close(gx_i, gx_b)
    for p, w in zip(lin.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w)


def test_memory_flat_over_steps():
    """20 steps: no stash left behind, the same peaks each step, no growth in live tensors."""
    sched = make_schedule("zbv", 1, 4)
    bm = build_model("mlp", sched.n_stages, seed=0, **SIZES["mlp"])
    pipe = Pipeline(sched, dict(enumerate(bm.stages)), bm.loss_fn)
    x, y = bm.make_batch(8, seed=0)
    counts, peaks = [], set()
    for step in range(20):
        pipe.step(x, y)
        assert pipe._executor.leftovers() == 0
        assert pipe._executor.live == 0 and pipe._executor.live_bytes == 0
        peaks.add((pipe.stats["peak_live_activations"], pipe.stats["peak_live_activation_bytes"]))
        if step in (2, 10, 19):
            gc.collect()
            tensor_types = (torch.Tensor, torch.nn.Parameter)
            counts.append(sum(1 for o in gc.get_objects() if type(o) in tensor_types))
    assert len(peaks) == 1 and next(iter(peaks))[1] > 0
    assert len(set(counts)) == 1, counts


def test_bad_modules_and_invalid_schedule_rejected_before_running():
    sched = make_schedule("zbv", 1, 2)
    bm = build_model("mlp", 2, seed=0, **SIZES["mlp"])
    with pytest.raises(PipelineError, match=r"rank 0: .*missing stage\(s\) \[1\]"):
        Pipeline(sched, {0: bm.stages[0]}, bm.loss_fn)
    with pytest.raises(PipelineError, match=r"stage\(s\) \[2\] not on this rank"):
        Pipeline(sched, {0: bm.stages[0], 1: bm.stages[1], 2: bm.stages[1]}, bm.loss_fn)
    # Microbatch 1 never runs backward on stage 1: rejected by validation.
    rows = actions_from_strings([["0F0", "1F0", "0F1", "1F1", "1B0", "0B0", "0B1"]])
    bad = schedule_from_rows(rows, name="bad")
    with pytest.raises(ScheduleError):
        Pipeline(bad, dict(enumerate(bm.stages)), bm.loss_fn)
    two_ranks = make_schedule("1f1b", 2, 2)
    with pytest.raises(PipelineError, match="not initialised"):
        Pipeline(two_ranks, {0: bm.stages[0]}, bm.loss_fn)


class _Fails(torch.nn.Module):
    def __init__(self, inner, bad_batch):
        super().__init__()
        self.inner, self.bad_batch, self.calls = inner, bad_batch, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.bad_batch:
            raise RuntimeError("boom")
        return self.inner(x)


def test_failing_action_is_named():
    sched = make_schedule("zbv", 1, 4)
    bm = build_model("mlp", 2, seed=0, **SIZES["mlp"])
    # Stage 1 is the loss stage (no shape probe): its second call is microbatch 1's F.
    modules = {0: bm.stages[0], 1: _Fails(bm.stages[1], 2)}
    pipe = Pipeline(sched, modules, bm.loss_fn)
    x, y = bm.make_batch(8, seed=0)
    with pytest.raises(
        PipelineError,
        match=r"^rank 0: action 1F1 \(stage 1, microbatch 1\) failed: RuntimeError: boom$",
    ):
        pipe.step(x, y)
    pipe.step(x, y)  # the pipeline recovers: stashes were dropped
    assert pipe._executor.leftovers() == 0


def _kill_rank1(rank: int, n_ranks: int) -> None:
    sched = make_schedule("1f1b", 2, 4)
    bm = build_model("mlp", 2, seed=0, **SIZES["mlp"])
    pipe = Pipeline(sched, {rank: bm.stages[rank]}, bm.loss_fn)
    x, y = bm.make_batch(8, seed=0)
    pipe.step(x if rank == 0 else None, y if rank == 1 else None)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    pipe.step(x if rank == 0 else None, y if rank == 1 else None)


def test_killed_rank_ends_the_job():
    with pytest.raises(PipelineError, match=r"rank 1 died \(killed by SIGKILL\)"):
        spawn(_kill_rank1, 2, timeout_s=60, pg_timeout_s=20)


def _raise_on_rank1(rank: int, n_ranks: int) -> int:
    if rank == 1:
        raise ValueError("bad thing\nsecond line")
    return rank


def test_failing_rank_is_named():
    with pytest.raises(PipelineError, match=r"^rank 1 failed: ValueError: bad thing$"):
        spawn(_raise_on_rank1, 2, timeout_s=60)
    assert spawn(_raise_on_rank1, 1, timeout_s=60) == [0]


def _static_shapes_job(rank: int, n_ranks: int) -> tuple[list[float], str]:
    """Static and per-step shape agreement give the same losses; a static pipeline fed a new
    batch shape refuses it on stage 0's rank before posting anything, and runs on after."""
    schedule = lower(make_schedule("interleaved-1f1b", n_ranks, 4))
    pipes = []
    for static in (False, True):
        bm = _build("mlp", schedule.n_stages)
        mods = {s: bm.stages[s] for s in schedule.stages_of(rank)}
        pipes.append(Pipeline(schedule, mods, bm.loss_fn, static_shapes=static))
    first, last = schedule.placement[0] == rank, schedule.loss_rank == rank
    x, y = _batch(bm, 8, seed=0)
    losses = []
    for _ in range(2):
        for pipe in pipes:
            out = pipe.step(x if first else None, y if last else None)
            losses.append([float(v) for v in out] if last else [])
    assert losses[0] == losses[1] and losses[2] == losses[3]
    refused = ""
    if first:
        x2, _ = _batch(bm, 12, seed=1)
        with pytest.raises(PipelineError) as info:
            pipes[1].step(x2, y if last else None)
        refused = str(info.value)
    out = pipes[1].step(x if first else None, y if last else None)
    return (losses[2] if last else []) + ([float(v) for v in out] if last else []), refused


def test_static_shapes_agree_once_and_refuse_a_new_shape():
    (l0, msg0), (l1, msg1) = spawn(_static_shapes_job, 2, timeout_s=120)
    assert msg1 == ""
    assert msg0 == (
        "rank 0: step 2: microbatch inputs [3, 16] float64 differ from the first step's "
        "[2, 16] float64, and the pipeline has static_shapes=True"
    )
    losses = l0 or l1
    assert len(losses) == 8 and losses[:4] == losses[4:]  # the third step repeats the batch


def _channel_jobs(rank: int, n_ranks: int, jobs: list) -> list:
    """Every job with comm_channels on (gloo here; the default on NCCL), then the routes of a
    pipeline built again: per peer, its own group each way, taken from the shared cache."""
    import vpipe.runtime.comm as comm

    for sched, model, steps in jobs:
        check_config(sched, model, rank, steps, comm_channels=True)
    made = len(comm._CHANNELS)
    sched = jobs[0][0]
    bm = _build("mlp", sched.n_stages)
    mods = {s: bm.stages[s] for s in sched.stages_of(rank)}
    routes = Pipeline(sched, mods, bm.loss_fn, comm_channels=True).comm._routes
    assert len(comm._CHANNELS) == made  # nothing created twice
    return made, {key: (id(group), index) for key, (group, index) in routes.items()}


@pytest.mark.parametrize("n_ranks", [2, 4])
def test_channels_give_the_reference_gradients(n_ranks):
    """One process group per direction between two ranks (what NCCL needs, see comm.py): the
    losses and gradients still equal the reference, at P=2 for every family, at P=4 for a
    loop and a V placement; each pair's two directions use different groups."""
    names = schedule_names() if n_ranks == 2 else ["interleaved-1f1b", "dualpipev"]
    jobs = [
        (make_schedule(name, n_ranks, 4), "mlp", reference_steps(
            make_schedule(name, n_ranks, 4).n_stages, 4, "mlp", False, repeat=False))
        for name in names
    ]  # fmt: skip
    results = spawn(_channel_jobs, n_ranks, jobs, timeout_s=600)
    # interleaved-1f1b (first at P=4) pairs ranks r and r+1, and P-1 with 0 (its loop wraps)
    pairs = {2: 1, 4: 4}[n_ranks]
    for rank, (made, routes) in enumerate(results):
        assert made == 2 * pairs
        peers = {peer for _, peer in routes}
        assert peers == ({1 - rank} if n_ranks == 2 else {(rank - 1) % 4, (rank + 1) % 4})
        for peer in peers:
            assert routes[True, peer][0] != routes[False, peer][0]
            assert routes[True, peer][1] == routes[False, peer][1] == int(peer > rank)


def _inline_posting_jobs(rank: int, n_ranks: int, jobs: list) -> bool:
    """Every job with gloo operations posted from the compute thread (no poster thread)."""
    for sched, model, steps in jobs:
        pipe_stats = check_config(sched, model, rank, steps, post_thread=False)
        assert pipe_stats["step_time_s"] > 0
    return True


def test_posting_without_the_poster_thread_gives_the_reference_gradients():
    """The poster thread is gloo's default (every other test here runs with it); posting
    inline, as before it, still gives the reference losses and gradients for every family."""
    jobs = [
        (make_schedule(name, 2, 4), "mlp", reference_steps(
            make_schedule(name, 2, 4).n_stages, 4, "mlp", False, repeat=False))
        for name in schedule_names()
    ]  # fmt: skip
    assert spawn(_inline_posting_jobs, 2, jobs, timeout_s=600) == [True, True]
