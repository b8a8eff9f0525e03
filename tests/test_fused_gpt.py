"""Part.ready() and the GPT model's opt-in fused forward-backward (``fused_fb=1``): dualpipev
with it matches the unpipelined model, and it runs the backward part first while the forward
part's input has not arrived."""

from __future__ import annotations

import pytest
import torch

from vpipe.ir import Kind
from vpipe.ir.lowering import lower
from vpipe.models import FusedStage, ModelError, Stage, build_model, resolve_sizes
from vpipe.runtime import Pipeline
from vpipe.runtime.executor import Posted, _arrived
from vpipe.runtime.launch import spawn
from vpipe.runtime.overlap import Part, Phases
from vpipe.schedules import make_schedule
from vpipe.sweep.harness import reference_step

SIZES = {"vocab": 32, "d_model": 16, "n_heads": 2, "seq_len": 8}
N_MB = 4


class _Work:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def _part(ready) -> Part:
    action = make_schedule("dualpipev", 1, N_MB).actions[0][0]
    return Part(action, Phases(lambda: "x", lambda fetch, deliver: deliver(fetch()), None, ready))


def test_part_ready_asks_its_probe_until_fetched():
    assert _part(None).ready()  # no probe: fetch never waits
    part = _part(lambda: False)
    assert not part.ready()
    assert part.fetch() == "x"
    assert part.ready()  # fetched: nothing left to wait for


def test_arrived_probe_waits_for_every_work_of_a_posted_receive():
    posted = Posted((), make_schedule("dualpipev", 1, N_MB).actions[0][0])
    posted.works = [_Work(True), _Work(False)]
    slot: dict = {0: posted, 1: (torch.zeros(1),)}
    assert not _arrived(slot, 0)()
    posted.works[1].done = True
    assert _arrived(slot, 0)()
    assert _arrived(slot, 1)()  # handed over locally
    assert _arrived(slot, 2)()  # missing: fetch fails at once rather than blocks


def test_fused_fb_is_an_opt_in_gpt_size_with_identical_parameters_and_outputs():
    assert "fused_fb" not in resolve_sizes("gpt", 4)
    assert resolve_sizes("gpt", 4, {"fused_fb": 0})["fused_fb"] == 0
    with pytest.raises(ModelError, match="fused_fb must be one of 0, 1"):
        resolve_sizes("gpt", 4, {"fused_fb": 2})
    with pytest.raises(ModelError, match="has no size 'fused_fb'"):
        resolve_sizes("mlp", 4, {"fused_fb": 1})
    plain = build_model("gpt", 3, seed=1, **SIZES)
    fused = build_model("gpt", 3, seed=1, fused_fb=1, **SIZES)
    assert all(type(m) is Stage for m in plain.stages)
    assert all(type(m) is FusedStage for m in fused.stages)
    for a, b in zip(plain.stages, fused.stages, strict=True):
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert na == nb and torch.equal(pa, pb)
    x, _ = plain.make_batch(2)
    torch.testing.assert_close(plain.reference_model()(x), fused.reference_model()(x))


def _model(n_stages: int):
    bm = build_model("gpt", n_stages, seed=1, fused_fb=1, **SIZES)
    for m in bm.stages:
        m.double()
    return bm


def _reference(n_stages: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Per-microbatch losses and every stage's parameter gradients, unpipelined."""
    bm = _model(n_stages)
    ref = bm.reference_model()
    losses = reference_step(ref, bm.loss_fn, *bm.make_batch(2 * N_MB), N_MB)
    return losses, [[p.grad for p in m.parameters()] for m in ref.stages]


def _overlaps(program, stage: int) -> int:
    """How many overlap actions have their forward part on ``stage``."""
    return sum(a.kind is Kind.OVERLAP_F_B and a.parts[0].stage == stage for a in program)


def fused_gpt_job(rank: int, n_ranks: int, ref_losses: list, ref_grads: list) -> list[int]:
    """Two steps of dualpipev on the fused GPT, the second with every ``ready()`` answering
    False (so each hook call must run the backward part first); checks both against the
    reference and returns, per step, how many hook calls chose backward first."""
    sched = make_schedule("dualpipev", n_ranks, N_MB)
    program = lower(sched).actions[rank]
    bm = _model(sched.n_stages)
    mine = {s: bm.stages[s] for s in sched.stages_of(rank)}
    pipe = Pipeline(sched, mine, bm.loss_fn)
    x, y = bm.make_batch(2 * N_MB)
    args = (x if 0 in mine else None, y if sched.loss_stage in mine else None)
    chose = []
    for step in range(2):
        if step == 1:
            Part.ready = lambda self: False  # this spawned process only
        for mod in mine.values():
            mod.zero_grad(set_to_none=True)
            mod.fused_calls = mod.backward_first = 0
        losses = pipe.step(*args)
        if sched.loss_stage in mine:
            for got, want in zip(losses, ref_losses, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
        for s, mod in mine.items():
            assert mod.fused_calls == _overlaps(program, s), (rank, s)
            for p, want in zip(mod.parameters(), ref_grads[s], strict=True):
                torch.testing.assert_close(p.grad, want, rtol=1e-9, atol=1e-12)
        assert pipe._executor.leftovers() == 0 and pipe._executor.live == 0
        chose.append(sum(mod.backward_first for mod in mine.values()))
    calls = sum(_overlaps(program, s) for s in mine)
    assert calls > 0 and chose[1] == calls, (rank, chose, calls)
    return chose


def test_dualpipev_with_the_fused_gpt_matches_the_reference():
    n_ranks = 2
    n_stages = make_schedule("dualpipev", n_ranks, N_MB).n_stages
    spawn(fused_gpt_job, n_ranks, *_reference(n_stages), timeout_s=120)


def test_bench_script_prints_each_launch_and_the_ratio():
    from bench.fused_overlap import compare

    sizes = {"vocab": 32, "d_model": 16, "n_heads": 2, "n_layers": 2, "seq_len": 8}
    lines = compare(1, sizes, batch=8, microbatches=4)
    assert [line.split()[:2] for line in lines[1:3]] == [["1", "0"], ["2", "1"]]
    assert lines[-1].startswith("all steps: fused_fb=0 ") and " ratio " in lines[-1]
