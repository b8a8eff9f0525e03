"""What a cost-adaptive scheduler optimises: a pipeline's per-stage costs, its memory model and
limit, the objective, and the timing of per-rank programs under them.

Times: a stage's forward ``f``, input gradient ``b`` (I) and weight gradient ``w``; a message
over the boundary between stages s and s+1 costs ``hop[s]`` when the two stages are on
different ranks (free on one rank). Every action starts as soon as its rank is free and its
input is there, as in :func:`vpipe.sim.simulate` with receives posted early enough.

Memory, per stage (the zero-bubble paper's model): a forward allocates ``alloc[s]``, its input
gradient frees ``freed_by_i[s]`` of it and its weight gradient the rest (a full backward B all
of it). With only units known the strict count is the default: a forward holds one stage's
share until its W (``freed_by_i = 0``).

Objectives: ``makespan`` (every rank starts together, the step ends when the last one ends: a
synchronous optimizer step) and ``span`` (the longest rank span, from a rank's first forward to
its last action: what a step costs when iterations overlap, the papers' measure).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vpipe.errors import ScheduleError
from vpipe.ir import Action, Kind

__all__ = ["OBJECTIVES", "Problem", "Timed", "check_objective", "time_programs"]

OBJECTIVES = ("makespan", "span")


def check_objective(objective: object) -> str:
    """``objective`` if it is one of :data:`OBJECTIVES`, else a ScheduleError saying which."""
    if objective not in OBJECTIVES:
        raise ScheduleError(f"objective must be 'makespan' or 'span', got {objective!r}")
    return str(objective)


@dataclass(frozen=True)
class Problem:
    """One scheduling problem: ``placement`` (stage -> rank; the stages form one chain 0..S-1),
    ``microbatches``, per-stage ``f``, ``b``, ``w``, per-boundary ``hop``, per-stage ``alloc``
    and ``freed_by_i`` (see the module docstring) and the per-rank memory ``limit`` in the same
    measure as ``alloc``."""

    placement: Mapping[int, int]
    microbatches: int
    f: Sequence[float]
    b: Sequence[float]
    w: Sequence[float]
    hop: Sequence[float]
    alloc: Sequence[float]
    freed_by_i: Sequence[float]
    limit: float = math.inf

    @property
    def n_stages(self) -> int:
        return len(self.placement)

    @property
    def n_ranks(self) -> int:
        return max(self.placement.values()) + 1

    def stages_of(self, rank: int) -> list[int]:
        return sorted(s for s, r in self.placement.items() if r == rank)

    def link(self, src: int, dst: int) -> float:
        """Delay of handing stage ``src``'s output to the adjacent stage ``dst``."""
        if self.placement[src] == self.placement[dst]:
            return 0.0
        return float(self.hop[min(src, dst)])

    def footprint(self, rank: int) -> float:
        """One microbatch's activations on ``rank`` when all its forwards there have run."""
        return float(sum(self.alloc[s] for s in self.stages_of(rank)))

    def work(self, rank: int) -> float:
        """Compute time of ``rank`` in one step."""
        return self.microbatches * sum(
            self.f[s] + self.b[s] + self.w[s] for s in self.stages_of(rank)
        )

    def delta(self, kind: Kind, stage: int) -> float:
        """Memory change of one action (see the module docstring)."""
        if kind is Kind.F:
            return float(self.alloc[stage])
        if kind is Kind.I:
            return -float(self.freed_by_i[stage])
        if kind is Kind.W:
            return -float(self.alloc[stage] - self.freed_by_i[stage])
        return -float(self.alloc[stage])  # B


@dataclass(frozen=True)
class Timed:
    """Per-rank programs with their times: ``start``/``end`` per rank in program order, each
    rank's peak memory (program order, the problem's measure), ``makespan`` and ``span``."""

    actions: list[list[Action]]
    start: list[list[float]]
    end: list[list[float]]
    peaks: list[float]

    @property
    def makespan(self) -> float:
        return max((e[-1] for e in self.end if e), default=0.0)

    @property
    def span(self) -> float:
        return max((e[-1] - s[0] for s, e in zip(self.start, self.end, strict=True) if e),
                   default=0.0)  # fmt: skip

    def objective(self, objective: str) -> float:
        return self.span if objective == "span" else self.makespan

    def bubble(self, problem: Problem, objective: str) -> float:
        """1 - the busiest rank's compute over the objective (the papers' bubble rate with
        ``span``)."""
        value = self.objective(objective)
        busiest = max(problem.work(r) for r in range(problem.n_ranks))
        return 1.0 - busiest / value if value > 0 else 0.0


def peaks_of(problem: Problem, actions: Sequence[Sequence[Action]]) -> list[float]:
    """Each rank's peak memory over its program order, in the problem's measure."""
    out = []
    for acts in actions:
        live = peak = 0.0
        for a in acts:
            live += problem.delta(a.kind, a.stage)
            peak = max(peak, live)
        out.append(peak)
    return out


def time_programs(problem: Problem, actions: Sequence[Sequence[Action]]) -> Timed:
    """Time complete per-rank programs (F, I, W and full backwards B) as they would run; a
    program that waits for an input that never comes is a ScheduleError naming the rank."""
    ranks, last = len(actions), problem.n_stages - 1
    arrive: dict[tuple[int, int, int], float] = {}  # (0 forward / 1 backward, stage, mb)
    pos = [0] * ranks
    free = [0.0] * ranks
    start: list[list[float]] = [[] for _ in range(ranks)]
    end: list[list[float]] = [[] for _ in range(ranks)]
    done_i: dict[tuple[int, int], float] = {}
    down = [problem.link(s, s + 1) for s in range(last)]  # forward hand-over after stage s
    up = [0.0] + [problem.link(s, s - 1) for s in range(1, last + 1)]  # backward, to s - 1
    f, b, w = problem.f, problem.b, problem.w
    progress = True
    while progress:
        progress = False
        for r in range(ranks):
            acts = actions[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                s, m = a.stage, a.microbatch
                if a.kind is Kind.F:
                    at = 0.0 if s == 0 else arrive.get((0, s, m))
                    cost = f[s]
                elif a.kind is Kind.W:
                    at = done_i.get((s, m))
                    cost = w[s]
                else:
                    at = arrive.get((1, s, m))
                    cost = b[s] + (w[s] if a.kind is Kind.B else 0.0)
                if at is None:
                    break
                t0 = max(free[r], at)
                t1 = t0 + cost
                free[r] = t1
                start[r].append(t0)
                end[r].append(t1)
                pos[r] += 1
                progress = True
                if a.kind is Kind.F:
                    if s < last:
                        arrive[(0, s + 1, m)] = t1 + down[s]
                    else:
                        arrive[(1, s, m)] = t1
                elif a.kind is not Kind.W:
                    done_i[(s, m)] = t1
                    if s > 0:
                        arrive[(1, s - 1, m)] = t1 + up[s]
    stuck = [r for r in range(ranks) if pos[r] < len(actions[r])]
    if stuck:
        r = stuck[0]
        raise ScheduleError(
            f"rank {r} waits forever at action {pos[r]} ({actions[r][pos[r]]}): its input is "
            "never produced"
        )
    return Timed([list(a) for a in actions], start, end, peaks_of(problem, actions))
