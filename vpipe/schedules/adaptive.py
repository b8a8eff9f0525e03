"""The cost-adaptive scheduler behind ``auto``: :func:`~vpipe.schedules.listsched.list_schedule`
under several priority rules, warm-ups and memory caps, keeping the best programs.

The search runs the configurations most likely to win first (the rules that won most often on
the zero-bubble paper's costs and on unit costs, each with its cost-derived warm-ups, at the full
limit; then the other rules; then lower caps) and stops when its work budget (actions
scheduled, so the time it takes grows with the pipeline's size, not the grid's) is spent.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from vpipe.errors import ScheduleError
from vpipe.schedules.listsched import Rule, list_schedule, warmup
from vpipe.schedules.problem import Problem, Timed, time_programs

__all__ = ["MemoryModel", "Found", "make_problem", "search"]

# actions the search may schedule in all (roughly 1 s per 50 000 on one core)
WORK_BUDGET = 150_000
_LOWER_CAPS = 4
_MIN_RUNS = 2  # configurations tried whatever the budget
_EXTRAS = (None, 0, -1, 1, 2)
_OVERRUNS = (0.0, 0.5)  # how far a W may run past the next input's arrival, in W's


@dataclass(frozen=True)
class MemoryModel:
    """Per-stage activation memory (the zero-bubble paper's model): ``alloc[s]`` allocated by
    a forward of stage s, ``freed_by_i[s]`` of it freed by its input gradient, the rest by its
    weight gradient. Units are the caller's (bytes, or 1F1B stage-activations)."""

    alloc: tuple[float, ...]
    freed_by_i: tuple[float, ...]

    @classmethod
    def strict(cls, n_ranks: int, n_stages: int) -> MemoryModel:
        """The strict count in 1F1B stages: a stage of 1/S of the model holds P/S of a 1F1B
        stage from its F to its W."""
        return cls((n_ranks / n_stages,) * n_stages, (0.0,) * n_stages)

    @classmethod
    def from_bytes(
        cls, alloc: Sequence[float], freed_by_i: Sequence[float] | None = None
    ) -> MemoryModel:
        """Measured bytes per stage: saved by F, and freed by I (default: none until W)."""
        a = tuple(float(x) for x in alloc)
        fi = tuple(float(x) for x in freed_by_i) if freed_by_i is not None else (0.0,) * len(a)
        if len(fi) != len(a) or any(x < 0 or y < 0 or y > x for x, y in zip(a, fi, strict=True)):
            raise ScheduleError(
                "memory model: need one alloc and one freed_by_i per stage, 0 <= freed_by_i <= "
                "alloc"
            )
        return cls(a, fi)


@dataclass(frozen=True)
class Found:
    """The best programs the search found and how (rule, warm-up extra, cap)."""

    timed: Timed
    rule: Rule
    extra: int | None
    cap: float

    def describe(self) -> str:
        r = self.rule
        warm = "none" if self.extra is None else f"{self.extra:+d}"
        return (
            f"list rule {'I' if r.backward_first else 'F'}-first guard {r.guard:g} "
            f"w-blind {int(r.w_blind)} depth {int(r.depth)} w-over {r.w_over:g} warm-up {warm} "
            f"cap {self.cap:g}"
        )


def make_problem(
    placement: Mapping[int, int],
    microbatches: int,
    times: tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[float]],
    memory: MemoryModel,
    limit: float,
) -> Problem:
    """A :class:`Problem` from per-stage (f, b, w, hop) and a memory model."""
    f, b, w, hop = (tuple(float(x) for x in t) for t in times)
    return Problem(placement, microbatches, f, b, w, hop, memory.alloc, memory.freed_by_i, limit)


def _caps(problem: Problem) -> list[float]:
    """The limit first, then up to ``_LOWER_CAPS`` lower caps, evenly spread down to the
    largest one-microbatch footprint (fewer microbatches in flight can shorten the I chain)."""
    low = max(problem.footprint(r) for r in range(problem.n_ranks))
    top = problem.limit
    if not math.isfinite(top):
        top = low * problem.microbatches
    steps = int((top - low) / low + 1e-9)  # whole footprints between the two
    picks = sorted({round(k * steps / _LOWER_CAPS) for k in range(_LOWER_CAPS)}, reverse=True)
    return [top] + [low + k * low for k in picks if low + k * low < top - 1e-9]


def _tapered(in_flight: list[int], extra: int, ranks_by_chain: list[int]) -> list[int]:
    """Warm-ups plus ``extra``, never more on a later rank of the chain than one less than on
    the rank before it (a rank cannot usefully start more than its upstream ones)."""
    out = list(in_flight)
    prev = None
    for r in ranks_by_chain:
        k = max(1, in_flight[r] + extra)
        if prev is not None:
            k = max(1, min(k, prev - 1))
        out[r] = prev = k
    return out


def _configs(problem: Problem) -> Iterator[tuple[Rule, int | None, float]]:
    """Every (rule, warm-up extra, cap) the search tries, the likeliest winners first: at the
    full limit, rules that run W's blind before those that wait, the deepest forward first
    before the oldest, smaller guards first, each with every warm-up (none, then the estimate,
    then one less and more) and I-first then F-first; then the lower caps without warm-ups
    (the cap already bounds them)."""
    depths = (True, False) if problem.n_stages > problem.n_ranks else (True,)
    kinds = list(itertools.product((True, False), depths, (0.0, 0.5, 1.0)))
    caps = _caps(problem)
    for blind, depth, guard in kinds:
        for extra in _EXTRAS:
            for first, over in itertools.product((True, False), _OVERRUNS):
                yield Rule(first, guard, blind, depth, over), extra, caps[0]
    for cap in caps[1:]:
        for blind, depth, guard in kinds:
            for first, over in itertools.product((True, False), _OVERRUNS):
                yield Rule(first, guard, blind, depth, over), None, cap


def search(problem: Problem, objective: str, budget: int = WORK_BUDGET) -> Found:
    """The best list schedule of ``problem`` under ``objective`` (ties: lower peak), trying
    configurations until ``budget`` actions have been scheduled (always at least one full
    few rules at the limit). A ScheduleError when the limit is below a microbatch's
    footprint on some rank, naming the smallest feasible limit."""
    low = max(problem.footprint(r) for r in range(problem.n_ranks))
    if problem.limit < low - 1e-9:
        raise ScheduleError(
            f"memory limit {problem.limit:g} fits no schedule: one microbatch's activations "
            f"on a rank need {low:g}; the smallest feasible limit is {low:g}"
        )
    per_run = 3 * problem.microbatches * problem.n_stages
    wu = warmup(problem)
    order = sorted(range(problem.n_ranks), key=lambda r: problem.stages_of(r)[0])
    best: tuple[tuple[float, float], Found] | None = None
    spent = 0
    for k, (rule, extra, cap) in enumerate(_configs(problem)):
        if spent >= budget and k >= _MIN_RUNS:
            break
        in_flight = None if extra is None else _tapered(wu, extra, order)
        spent += per_run
        try:
            timed = list_schedule(problem, rule, cap, in_flight)
        except ScheduleError:
            continue
        # as the programs will run: each action as early as its rank and input allow (the
        # list scheduler may have waited where its order, replayed, does not)
        timed = time_programs(problem, timed.actions)
        key = (timed.objective(objective), max(timed.peaks))
        if best is None or key < best[0]:
            best = (key, Found(timed, rule, extra, cap))
    if best is None:
        raise ScheduleError("the list scheduler found no schedule (every configuration stalled)")
    return best[1]
