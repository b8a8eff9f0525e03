"""Exact mode: the optimal schedule of a small pipeline from a constraint solver (OR-Tools
CP-SAT, the optional extra ``vpipe[solver]``, imported only here and only when asked).

The model: one interval per F, I and W of every stage and microbatch, of the stage's cost;
precedence along the chain (a forward after the previous stage's forward plus the message
time, the last stage's I after its F, an I after the next stage's I plus the message, a W
after its I); no two intervals of one rank overlap; microbatches run in order on every stage
and kind (they are interchangeable, so this loses nothing and removes symmetric solutions);
per rank a reservoir of activation memory (F allocates at its start, I and W free at their
end, :mod:`vpipe.schedules.problem`'s model) that never exceeds the limit; the objective is
the makespan or the longest rank span (with each rank's work as a redundant lower bound on its
span, which the solver proves bounds with). The solver starts from the heuristic's schedule (a
hint), runs under a time limit, and reports its best objective, the proven lower bound and
the gap between them; when the time runs out before it finds anything better, the heuristic's
schedule comes back with the solver's bound.

Times and memory are scaled to integers (the solver's domain): ``TIME_STEPS`` steps for the
largest cost, ``MEMORY_STEPS`` for the largest allocation; figures are reported back in the
problem's units.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from vpipe.errors import VpipeError
from vpipe.ir import Action, Kind
from vpipe.schedules._common import F, I, W
from vpipe.schedules.problem import Problem, Timed, check_objective, time_programs

__all__ = ["Exact", "SolverMissing", "solve"]

TIME_STEPS = 100_000
MEMORY_STEPS = 1000


class SolverMissing(VpipeError, ImportError):
    """The exact mode was asked for without OR-Tools installed."""


def _cp_model() -> Any:
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise SolverMissing(
            "the exact mode needs OR-Tools' CP-SAT solver: pip install 'vpipe[solver]' "
            "(or pip install ortools)"
        ) from None
    return cp_model


@dataclass(frozen=True)
class Exact:
    """The solver's answer: the best programs found (``timed``, in the problem's units), its
    ``status`` (``optimal``: proven; ``feasible``: the time limit ran out first), the
    ``objective`` of the best schedule, the proven lower ``bound``, the relative ``gap``
    between them, and the solver's wall time."""

    timed: Timed
    status: str
    objective: float
    bound: float
    wall_s: float

    @property
    def gap(self) -> float:
        return (self.objective - self.bound) / self.objective if self.objective > 0 else 0.0

    def to_dict(self) -> dict[str, float | str]:
        return {
            "status": self.status,
            "objective": self.objective,
            "bound": self.bound,
            "gap": self.gap,
            "wall_s": self.wall_s,
        }


def solve(
    problem: Problem,
    objective: str,
    hint: Timed | None = None,
    *,
    time_limit: float = 60.0,
    workers: int = 2,
) -> Exact:
    """The best schedule of ``problem`` by ``objective`` the solver finds within
    ``time_limit`` seconds on ``workers`` threads, started from ``hint`` (see the module
    docstring)."""
    cp_model = _cp_model()
    objective = check_objective(objective)
    n, mbs, p = problem.n_stages, problem.microbatches, problem.n_ranks
    kinds = ((Kind.F, problem.f), (Kind.I, problem.b), (Kind.W, problem.w))
    top = max([*problem.f, *problem.b, *problem.w, *problem.hop, 1e-12])
    scale = TIME_STEPS / top
    dur = {k: [round(c * scale) for c in costs] for k, costs in kinds}
    hop = [round(problem.link(s, s + 1) * scale) for s in range(n - 1)]
    horizon = sum(mbs * (dur[Kind.F][s] + dur[Kind.I][s] + dur[Kind.W][s]) for s in range(n))
    horizon += 2 * mbs * sum(hop)
    model = cp_model.CpModel()
    start: dict[tuple[Kind, int, int], Any] = {}
    end: dict[tuple[Kind, int, int], Any] = {}
    per_rank: list[list[Any]] = [[] for _ in range(p)]
    for kind, _ in kinds:
        for s in range(n):
            for m in range(mbs):
                key = (kind, s, m)
                st = model.new_int_var(0, horizon, f"{kind.value}{s}_{m}")
                en = model.new_int_var(0, horizon, f"e{kind.value}{s}_{m}")
                itv = model.new_interval_var(st, dur[kind][s], en, f"i{kind.value}{s}_{m}")
                start[key], end[key] = st, en
                per_rank[problem.placement[s]].append(itv)
    for s in range(n):
        for m in range(mbs):
            if s > 0:
                model.add(start[Kind.F, s, m] >= end[Kind.F, s - 1, m] + hop[s - 1])
            if s == n - 1:
                model.add(start[Kind.I, s, m] >= end[Kind.F, s, m])
            else:
                model.add(start[Kind.I, s, m] >= end[Kind.I, s + 1, m] + hop[s])
            model.add(start[Kind.W, s, m] >= end[Kind.I, s, m])
            if m:
                for kind, _ in kinds:
                    model.add(start[kind, s, m] >= start[kind, s, m - 1])
    for itvs in per_rank:
        model.add_no_overlap(itvs)
    _memory(model, problem, start, end)
    ends = [end[Kind.W, s, m] for s in range(n) for m in range(mbs)]
    goal = model.new_int_var(0, horizon, "objective")
    if objective == "makespan":
        model.add_max_equality(goal, ends)
    else:
        for r in range(p):
            st = problem.stages_of(r)
            first = model.new_int_var(0, horizon, f"first{r}")
            last = model.new_int_var(0, horizon, f"last{r}")
            model.add_min_equality(first, [start[Kind.F, s, m] for s in st for m in range(mbs)])
            model.add_max_equality(last, [end[Kind.W, s, m] for s in st for m in range(mbs)])
            model.add(goal >= last - first)
            # redundant, for the bound: a rank's span holds all its work
            work = sum(mbs * (dur[Kind.F][x] + dur[Kind.I][x] + dur[Kind.W][x]) for x in st)
            model.add(last - first >= work)
        model.add(start[Kind.F, 0, 0] == 0)  # spans do not change when everything shifts
    model.minimize(goal)
    if hint is not None:
        for r, acts in enumerate(hint.actions):
            for a, t0 in zip(acts, hint.start[r], strict=True):
                if a.kind in (Kind.F, Kind.I, Kind.W):
                    model.add_hint(start[a.kind, a.stage, a.microbatch], round(t0 * scale))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    t0 = time.perf_counter()
    status = solver.solve(model)
    wall = time.perf_counter() - t0
    bound = solver.best_objective_bound / scale
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        rows: list[list[tuple[int, int, Action]]] = [[] for _ in range(p)]
        order = {Kind.F: 0, Kind.I: 1, Kind.W: 2}
        for (kind, s, m), var in start.items():
            make = {Kind.F: F, Kind.I: I, Kind.W: W}[kind]
            rows[problem.placement[s]].append((solver.value(var), order[kind], make(s, m)))
        actions = [[a for _, _, a in sorted(row)] for row in rows]
        timed = time_programs(problem, actions)  # the programs' times in the problem's units
        if hint is not None and hint.objective(objective) <= timed.objective(objective):
            timed = hint  # rounding can make the solver's order no better than the hint
        label = "optimal" if status == cp_model.OPTIMAL else "feasible"
    elif hint is not None:
        timed, label = hint, "feasible"
    else:
        raise VpipeError(
            f"the solver found no schedule in {time_limit:g} s (status "
            f"{solver.status_name(status)}); give it more time or a looser memory limit"
        )
    value = timed.objective(objective)
    return Exact(timed, label, value, min(bound, value), wall)


def _memory(model: Any, problem: Problem, start: dict, end: dict) -> None:
    """Per rank, activation memory as a reservoir that stays within the limit."""
    if not math.isfinite(problem.limit):
        return
    top = max([*problem.alloc, 1e-12])
    unit = MEMORY_STEPS / top
    limit = math.floor(problem.limit * unit + 1e-6)
    for r in range(problem.n_ranks):
        times, changes = [], []
        for s in problem.stages_of(r):
            a = round(problem.alloc[s] * unit)
            fi = round(problem.freed_by_i[s] * unit)
            for m in range(problem.microbatches):
                times += [start[Kind.F, s, m], end[Kind.I, s, m], end[Kind.W, s, m]]
                changes += [a, -fi, -(a - fi)]
        model.add_reservoir_constraint(times, changes, 0, limit)
