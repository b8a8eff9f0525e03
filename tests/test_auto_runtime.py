"""Schedules auto emits beyond the catalogue's row (loop and interleaved placements, the span
objective, a memory model freeing at I, the exact mode) lower, validate and give the unsplit
model's losses and gradients on the runtime at P = 2 and 4 (tiny: one step each)."""

from __future__ import annotations

import pytest
from test_runtime import check_config, reference_steps

from vpipe.ir.lowering import lower, validate
from vpipe.runtime.launch import spawn
from vpipe.schedules.adaptive import MemoryModel
from vpipe.schedules.auto import auto_schedule
from vpipe.sim import CostModel

PAPER = CostModel(f=18.522, b=18.086, w=9.337, comm_latency=0.601)


def _schedules(p: int) -> list:
    out = [
        auto_schedule(p, 5, PAPER, p, "loop", objective="span"),
        auto_schedule(p, 4, CostModel(f=1, b=2, w=1), 1.5 * p, "interleaved", stages_per_rank=2),
        auto_schedule(
            p, 3, PAPER, 1.5, "loop", objective="span",
            memory=MemoryModel.from_bytes([1.0] * p, [0.7] * p),
        ),
    ]  # fmt: skip
    if p == 2:
        pytest.importorskip("ortools")
        out.append(auto_schedule(p, 3, PAPER, p, "loop", objective="span", exact=True))
    return out


def _run(rank: int, n_ranks: int, jobs: list) -> int:
    for sched, steps in jobs:
        check_config(sched, "mlp", rank, steps)
    return len(jobs)


@pytest.mark.parametrize("n_ranks", [2, 4])
def test_auto_schedules_run_with_reference_gradients(n_ranks):
    jobs = []
    for s in _schedules(n_ranks):
        validate(lower(s))
        jobs.append((s, reference_steps(s.n_stages, s.n_microbatches, "mlp", False, False)))
    assert spawn(_run, n_ranks, jobs, timeout_s=300) == [len(jobs)] * n_ranks
