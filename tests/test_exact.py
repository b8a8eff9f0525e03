"""auto's exact mode (OR-Tools CP-SAT): small pipelines proven optimal, the heuristic within
2% of the optimum, a time-out that returns the best found with its gap, and a clear message
when the solver is not installed."""

from __future__ import annotations

import sys

import pytest

from vpipe.ir import loop_placement
from vpipe.ir.lowering import lower, validate
from vpipe.schedules.adaptive import MemoryModel, make_problem, search
from vpipe.schedules.auto import auto_schedule
from vpipe.schedules.exact import SolverMissing, solve
from vpipe.sim import CostModel, simulate

PAPER = (18.522, 18.086, 9.337, 0.601)  # 1.5B F, B, W, comm (ms)


def _problem(p: int, m: int, limit: float, costs=PAPER):
    f, b, w, c = costs
    times = ([f] * p, [b] * p, [w] * p, [c] * (p - 1))
    return make_problem(loop_placement(p, p), m, times, MemoryModel.strict(p, p), limit)


@pytest.mark.parametrize("objective", ["makespan", "span"])
@pytest.mark.parametrize("p,m,limit", [(2, 4, 2), (4, 8, 4), (4, 8, 8)])
def test_small_pipelines_are_proven_optimal_and_the_heuristic_is_close(p, m, limit, objective):
    pytest.importorskip("ortools")
    prob = _problem(p, m, limit)
    heuristic = search(prob, objective)
    answer = solve(prob, objective, heuristic.timed, time_limit=60, workers=2)
    assert answer.status == "optimal"
    assert answer.gap <= 1e-3  # integer scaling of the costs only
    assert max(answer.timed.peaks) <= limit
    assert answer.objective <= heuristic.timed.objective(objective) + 1e-9
    assert heuristic.timed.objective(objective) <= 1.02 * answer.objective


def test_auto_exact_mode_lowers_and_simulates_to_its_objective():
    pytest.importorskip("ortools")
    f, b, w, c = PAPER
    costs = CostModel(f=f, b=b, w=w, comm_latency=c)
    s = auto_schedule(4, 6, costs, 4, "loop", objective="span", exact=True, time_limit=30)
    assert s.meta["exact"]["status"] == "optimal"
    validate(lower(s))
    res = simulate(s, costs)
    assert res.span == pytest.approx(s.meta["objective_value"])
    assert max(res.peak_stage_activations) <= 4


def test_a_time_out_returns_the_best_found_with_its_gap():
    pytest.importorskip("ortools")
    prob = _problem(6, 24, 6)
    heuristic = search(prob, "span")
    answer = solve(prob, "span", heuristic.timed, time_limit=0.01, workers=1)
    assert answer.status == "feasible"
    assert answer.objective <= heuristic.timed.span + 1e-9
    assert answer.bound <= answer.objective
    assert answer.gap == pytest.approx((answer.objective - answer.bound) / answer.objective)


def test_a_missing_solver_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ortools", None)
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    with pytest.raises(SolverMissing, match=r"pip install 'vpipe\[solver\]'"):
        solve(_problem(2, 2, 2), "span")
