"""Faults end the whole job with a clear error naming rank, stage and action; never a hang."""

import os
import re
import signal
import time

import pytest
import torch
from torch import nn

from vpipe.cli import main
from vpipe.errors import PipelineError

SIZES = {"d_model": 8, "d_hidden": 16}


class Fault(nn.Module):
    """Wraps a stage; on its ``at``-th forward call does ``what`` ("raise", "kill", "shape")."""

    def __init__(self, inner: nn.Module, what: str, at: int) -> None:
        super().__init__()
        self.inner, self.what, self.at, self.calls = inner, what, at, 0

    def forward(self, x):
        self.calls += 1
        out = self.inner(x)
        if self.calls >= self.at:
            if self.what == "raise":
                raise RuntimeError("injected failure")
            if self.what == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.what == "shape":  # a different output shape than the first step inferred
                return out[:, :-1]
        return out


def _faulty_job(rank, n_ranks, name, fault_stage, what, at):
    from vpipe.ir.lowering import lower
    from vpipe.models import build_model
    from vpipe.runtime import Pipeline
    from vpipe.schedules import make_schedule

    schedule = lower(make_schedule(name, n_ranks, 4))
    model = build_model("mlp", schedule.n_stages, **SIZES)
    modules = {
        s: Fault(model.stages[s], what, at) if s == fault_stage else model.stages[s]
        for s in schedule.stages_of(rank)
    }
    pipe = Pipeline(schedule, modules=modules, loss_fn=model.loss_fn)
    x, y = model.make_batch(8)
    for _ in range(3):
        pipe.step(
            x if rank == schedule.placement[0] else None, y if rank == schedule.loss_rank else None
        )
    return "finished"


def _expect_failure(name, fault_stage, what, at, timeout_s=120):
    from vpipe.runtime.launch import spawn

    t0 = time.monotonic()
    with pytest.raises(PipelineError) as info:
        spawn(_faulty_job, 2, name, fault_stage, what, at, timeout_s=timeout_s)
    return str(info.value), time.monotonic() - t0


def test_killed_rank_ends_job_within_bound():
    # zbv: stage 2 lives on rank 1; its 6th forward is in the second step, mid-step.
    msg, elapsed = _expect_failure("zbv", 2, "kill", 6)
    assert re.search(r"rank 1\b", msg), msg
    assert re.search(r"kill|signal|SIGKILL|died|exit", msg, re.I), msg
    assert elapsed < 60, f"job took {elapsed:.0f} s to end after a rank was killed"


def test_module_exception_names_rank_stage_and_action():
    # 1f1b on 2 ranks: stage 1 on rank 1 raises at its third forward (microbatch 2).
    msg, _ = _expect_failure("1f1b", 1, "raise", 3)
    assert re.search(r"rank 1\b", msg), msg
    assert re.search(r"stage 1\b", msg), msg
    assert "1F2" in msg, msg
    assert "injected failure" in msg, msg


def test_shape_change_between_steps_is_an_error_not_a_hang():
    # rank 0's stage 0 sends a narrower tensor from its fifth forward (step 2) on.
    msg, elapsed = _expect_failure("1f1b", 0, "shape", 5, timeout_s=60)
    assert re.search(r"rank [01]\b", msg), msg
    assert elapsed < 60


def test_invalid_schedule_rejected_before_any_process_starts(tmp_path, monkeypatch, capsys):
    import vpipe.runtime.launch as launch

    def no_spawn(*args, **kwargs):
        raise AssertionError("a process was started for an invalid schedule")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0B0\n1F0,1X0\n")
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.csv:2" in err and "rank 1" in err and "1X0" in err
    # a schedule whose program deadlocks: both ranks wait on a backward first
    stuck = tmp_path / "stuck.csv"
    stuck.write_text("0B0,0F0\n1F0,1B0\n")
    assert main(["run", str(stuck)]) == 2
    assert "rank" in capsys.readouterr().err
    assert main(["run", "no-such-schedule", "--ranks", "2", "--microbatches", "2"]) == 2
    assert "unknown schedule" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_request_without_a_gpu_is_rejected_before_spawn(monkeypatch, capsys):
    import vpipe.runtime.launch as launch

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("spawned"))
    assert main(["run", "1f1b", "-p", "2", "-m", "2", "--batch", "4", "--device", "cuda"]) == 2
    assert "CUDA" in capsys.readouterr().err
