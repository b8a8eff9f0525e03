"""A training iteration as the papers measure it: the simulated pipeline step, then what ends
an iteration, which the pipeline simulation leaves out.

After its last backward a rank waits for its gradient reductions (data parallel, simulated by
:mod:`vpipe.sim.collectives` under the pipeline's compute) and for the end-of-step collectives
it takes part in (``tail``: e.g. the all-reduce of a tied embedding's gradient between the
first and last stage), then steps its optimizer (``optimizer_step``, per rank). How ranks meet
there is the optimizer's synchronisation:

- **synchronous** (Megatron's default, and vpipe's runtime): a global all-reduce of the
  gradient norm (and, in fp16, of the overflow check) holds every rank until the last one is
  ready (``sync``: the time of those all-reduces); then all step, and the next iteration starts
  on every rank together. Iteration time: ``max(ready) + sync + max(optimizer_step)``.
- **post-validated** (the zero-bubble paper's optimizer, section 4): each rank steps as soon as
  it is ready and checks the global state in the next iteration, so iterations overlap and no
  rank waits for another at the boundary. Iteration time: the longest of each rank's span
  (its first compute to its readiness) plus its own step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from vpipe.sim.collectives import COMPUTE_CODES, DPStep

__all__ = ["Iteration", "IterationCosts", "iteration"]


@dataclass(frozen=True)
class IterationCosts:
    """What ends an iteration, in the simulator's time units: per rank its optimizer step and
    end-of-step collectives (``tail``), the global synchronisation's time (``sync``), and
    whether the optimizer is post-validated (no global wait)."""

    optimizer_step: Sequence[float]
    tail: Sequence[float] = ()
    sync: float = 0.0
    post_validated: bool = False


@dataclass(frozen=True)
class Iteration:
    """One iteration's time and where it went (the simulator's time units)."""

    time: float
    pipeline: float  # the pipeline step alone (makespan, or longest span when post-validated)
    ready: list[float]  # per rank: its last backward, reductions and tail collectives done
    start: list[float]  # per rank: its first compute
    exposed_reduction: float  # what data-parallel reductions added to the pipeline step

    @property
    def end_overhead(self) -> float:
        """What the iteration's end (reductions, collectives, sync, optimizer) added."""
        return self.time - self.pipeline


def iteration(
    columns: Mapping[str, np.ndarray],
    n_ranks: int,
    costs: IterationCosts,
    reductions: DPStep | None = None,
) -> Iteration:
    """The iteration of a simulated step (``columns``: :attr:`vpipe.sim.SimResult.columns`)
    ending as ``costs`` says, with the data-parallel ``reductions`` of that step if any."""
    rank, kind = np.asarray(columns["rank"]), np.asarray(columns["kind"])
    start, end = np.asarray(columns["start"]), np.asarray(columns["end"])
    compute = kind < COMPUTE_CODES
    first, last = np.full(n_ranks, np.inf), np.full(n_ranks, -np.inf)
    np.minimum.at(first, rank[compute], start[compute])
    np.maximum.at(last, rank[compute], end[compute])
    idle = np.bincount(rank[compute], minlength=n_ranks)[:n_ranks] == 0
    first[idle], last[idle] = 0.0, 0.0
    done = last.copy()
    if reductions is not None:
        for red in reductions.reductions:
            done[red.rank] = max(done[red.rank], red.end)
    tail = np.zeros(n_ranks) if len(costs.tail) == 0 else np.asarray(costs.tail, float)
    step = np.asarray(costs.optimizer_step, float)
    ready = done + tail
    if costs.post_validated:
        pipeline = float((last - first).max())
        time = float((ready - first + step).max())
        exposed = float((done - first).max()) - pipeline
    else:
        pipeline = float(last.max())
        time = float(ready.max() + costs.sync + step.max())
        exposed = float(done.max()) - pipeline
    return Iteration(time, pipeline, ready.tolist(), first.tolist(), max(exposed, 0.0))
