"""The overlap seam: a stage module's ``overlapped_forward_backward`` runs dualpipev's
``(F;B)OVERLAP_F_B`` actions in its own order, with the losses and gradients of the unpipelined
model, the same profiler spans, and failures named by part."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vpipe.errors import PipelineError
from vpipe.ir import Kind
from vpipe.ir.lowering import lower
from vpipe.models import build_model
from vpipe.runtime import Pipeline
from vpipe.runtime.launch import spawn
from vpipe.runtime.overlap import Part
from vpipe.runtime.recompute import RECOMPUTABLE_SPAN
from vpipe.schedules import make_schedule
from vpipe.sweep.harness import reference_step

SIZES = {"d_model": 8, "d_hidden": 16}
N_MB = 4


class Fused(nn.Module):
    """A stage that runs its overlap actions backward part first, steps interleaved, and
    records each call; ``fail`` makes its forward raise inside the hook's forward part."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[tuple[str, str]] = []
        self.fail = self.in_hook = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail and self.in_hook:
            raise RuntimeError("boom")
        return self.inner(x)

    def overlapped_forward_backward(self, forward: Part, backward: Part) -> None:
        self.calls.append((str(forward.action), str(backward.action)))
        self.in_hook = True
        try:
            backward.fetch()
            forward.fetch()
            backward.compute()
            forward.compute()
            backward.deliver()
            forward.deliver()
        finally:
            self.in_hook = False


def _model(n_stages: int):
    bm = build_model("mlp", n_stages, seed=1, **SIZES)
    for m in bm.stages:
        m.double()
    return bm


def _batch(bm) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = bm.make_batch(2 * N_MB, seed=0)
    return x.double(), y.double()


def _reference(n_stages: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Per-microbatch losses and every stage's parameter gradients, unpipelined."""
    bm = _model(n_stages)
    ref = bm.reference_model()
    losses = reference_step(ref, bm.loss_fn, *_batch(bm), N_MB)
    return losses, [[p.grad for p in m.parameters()] for m in ref.stages]


def _expected_calls(program, stage: int) -> list[tuple[str, str]]:
    """The (F, B) parts of each overlap action whose forward part is on ``stage``."""
    out = []
    for a in program:
        if a.kind is Kind.OVERLAP_F_B and a.parts[0].stage == stage:
            out.append((str(a.parts[0]), str(a.parts[1])))
    return out


def fused_job(rank: int, n_ranks: int, ref_losses: list, ref_grads: list) -> list[str]:
    """Two steps of dualpipev with fused stages (the second profiled), checked against the
    reference; returns the PP: span names of the profiled step."""
    sched = make_schedule("dualpipev", n_ranks, N_MB)
    program = lower(sched).actions[rank]
    assert any(a.kind is Kind.OVERLAP_F_B for a in program)
    bm = _model(sched.n_stages)
    mine = {s: Fused(bm.stages[s]) for s in sched.stages_of(rank)}
    pipe = Pipeline(sched, mine, bm.loss_fn)
    x, y = _batch(bm)
    args = (x if 0 in mine else None, y if sched.loss_stage in mine else None)
    for step in range(2):
        for mod in mine.values():
            mod.zero_grad(set_to_none=True)
            mod.calls.clear()
        if step == 0:
            losses = pipe.step(*args)
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities) as prof:
                losses = pipe.step(*args)
        if sched.loss_stage in mine:
            for got, want in zip(losses, ref_losses, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
        for s, mod in mine.items():
            assert mod.calls == _expected_calls(program, s), (rank, s)
            for p, want in zip(mod.parameters(), ref_grads[s], strict=True):
                torch.testing.assert_close(p.grad, want, rtol=1e-9, atol=1e-12)
        assert pipe._executor.leftovers() == 0 and pipe._executor.live == 0
    return sorted({e.name for e in prof.events() if e.name.startswith("PP:")})


def test_fused_hook_matches_the_reference_with_the_same_spans():
    n_ranks = 2
    sched = lower(make_schedule("dualpipev", n_ranks, N_MB))
    spans = spawn(fused_job, n_ranks, *_reference(sched.n_stages), timeout_s=120)
    for rank, got in enumerate(spans):
        program = sched.actions[rank]
        want = {f"PP:{a}" for a in program} | {"PP:STEP:1"}
        want |= {f"PP:WAIT:{a}" for a in program if a.kind in (Kind.RECV_F, Kind.RECV_B)}
        # each part of an overlap action is a span of its own, inside the compound's
        want |= {f"PP:{p}" for a in program if a.kind is Kind.OVERLAP_F_B for p in a.parts}
        want |= {RECOMPUTABLE_SPAN}  # the MLP's activation functions, marked for recomputation
        assert set(got) == want, (rank, sorted(set(got) ^ want))


def _single_rank(hook=None):
    """dualpipev on one rank with fused stages (``hook`` replacing their method), and the
    first overlap action of its program."""
    sched = make_schedule("dualpipev", 1, N_MB)
    bm = _model(sched.n_stages)
    mods = {s: Fused(m) for s, m in enumerate(bm.stages)}
    if hook is not None:
        for mod in mods.values():
            mod.overlapped_forward_backward = hook
    pipe = Pipeline(sched, mods, bm.loss_fn)
    first = next(a for a in pipe.schedule.actions[0] if a.kind is Kind.OVERLAP_F_B)
    return pipe, mods, first, _batch(bm)


def test_failure_in_the_hooks_forward_part_names_the_part():
    pipe, mods, first, (x, y) = _single_rank()
    f = first.parts[0]
    mods[f.stage].fail = True
    want = (
        rf"^rank 0: action {f} in \({first.parts[0]};{first.parts[1]}\)OVERLAP_F_B "
        rf"\(stage {f.stage}, microbatch {f.microbatch}\) failed: RuntimeError: boom$"
    )
    with pytest.raises(PipelineError, match=want):
        pipe.step(x, y)
    mods[f.stage].fail = False
    pipe.step(x, y)  # the pipeline recovers: stashes and parts were dropped
    assert pipe._executor.leftovers() == 0


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (lambda f, b: f.run(), r"action 0B0 in .* failed: .* returned before finishing it$"),
        (lambda f, b: (f.compute(), b.run()), r"action 1F1 in .* failed: compute\(\) out of order"),
        (
            lambda f, b: (f.run(), b.run(), 1 / 0),
            r"action \(1F1;0B0\)OVERLAP_F_B failed: stage 1's overlapped_forward_backward: "
            r"ZeroDivisionError",
        ),
    ],
    ids=["part-left-unfinished", "step-out-of-order", "error-in-the-hook-itself"],
)
def test_hook_misuse_is_named(hook, message):
    pipe, _, first, (x, y) = _single_rank(hook)
    assert str(first) == "(1F1;0B0)OVERLAP_F_B"
    with pytest.raises(PipelineError, match=message):
        pipe.step(x, y)
