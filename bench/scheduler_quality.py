"""Scheduler quality: ``auto``'s bubble next to the fixed families', the exact solver's optimum
or bound, and the wall times.

Three tables, all simulated (:func:`vpipe.sim.simulate`), bubble = 1 - busiest rank's compute
/ objective (with ``span``, the papers' 1 - M(F+B+W) / longest rank span):

1. The zero-bubble paper's four models at the pipeline sizes it ran them (1.5B and 6.2B at P =
   8, 14.6B at P = 16, 28.3B at P = 32; one stage per rank) with the per-pass costs it profiled
   for each model and M (its Table 9, ms), strict memory count, limits P and 2P, objective span:
   auto (loop placement) and its wall time, sail-sg's heuristic (zb.py, its best of 8 rule
   settings, run outside vpipe on the same costs and limits and replayed in vpipe's simulator:
   reference figures, not rerun here), the loop families that fit (1F1B, ZB-H1, ZB-H2) and,
   with ``--paper-solver``, the solver's best and proven bound on the P = 8 rows.
1b. ``v-half`` and ``v-min`` by name, built for the costs (cost-adapted: auto on the V
   placement at their memory), next to the block-built V-Half/V-Min and sail-sg's
   (zbv_greedy.py, reference figures), unit costs at P = 4, 6, 8 (M = 3P) and the 1.5B costs at
   P = 8, M = 24; the peak is in 1F1B stages.
2. A grid of small pipelines (P <= 4, M <= 8, unit and 1.5B costs, limits P and 2P, both
   objectives): the heuristic, the solver's proven optimum and the heuristic's distance from it.
3. The heuristic's wall time at P = 32, M = 256 on both placements.

Run: ``python -m bench.scheduler_quality [--quick] [--solver-time 60] [--no-solver]``
(the solver needs ``pip install 'vpipe[solver]'``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

PAPER_15B = (18.522, 18.086, 9.337, 0.601)
# The zero-bubble paper's Table 9: (model, P, M) -> profiled F, B, W, comm (ms per stage).
PAPER_COSTS = {
    ("1.5B", 8, 24): (18.522, 18.086, 9.337, 0.601),
    ("1.5B", 8, 32): (18.513, 18.086, 9.331, 0.626),
    ("1.5B", 8, 64): (18.546, 18.097, 9.321, 0.762),
    ("6.2B", 8, 24): (29.718, 29.444, 19.927, 0.527),
    ("6.2B", 8, 32): (29.802, 29.428, 19.530, 0.577),
    ("6.2B", 8, 64): (29.935, 29.621, 19.388, 0.535),
    ("14.6B", 16, 48): (11.347, 11.248, 8.132, 0.377),
    ("14.6B", 16, 64): (11.307, 11.254, 8.101, 0.379),
    ("14.6B", 16, 128): (11.325, 11.308, 8.109, 0.378),
    ("28.3B", 32, 96): (10.419, 10.207, 7.715, 0.408),
    ("28.3B", 32, 128): (10.408, 10.204, 7.703, 0.408),
    ("28.3B", 32, 256): (10.402, 10.248, 7.698, 0.460),
}
# sail-sg's zb.py on those costs, strict count (F +1, W -1, B 0): its longest rank span (ms) by
# (model, M, limit), run outside vpipe (best of its 8 rule settings, each replayed in vpipe's
# simulator, which times them as zb.py does).
SAIL_SG = {
    ("1.5B", 24, 8): 1310.405, ("1.5B", 24, 16): 1227.295,
    ("1.5B", 32, 8): 1678.164, ("1.5B", 32, 16): 1594.752,
    ("1.5B", 64, 8): 3154.286, ("1.5B", 64, 16): 3069.050,
    ("6.2B", 24, 8): 2187.537, ("6.2B", 24, 16): 2020.743,
    ("6.2B", 32, 8): 2814.376, ("6.2B", 32, 16): 2650.058,
    ("6.2B", 64, 8): 5348.572, ("6.2B", 64, 16): 5185.978,
    ("14.6B", 48, 16): 1714.461, ("14.6B", 48, 32): 1573.039,
    ("14.6B", 64, 16): 2202.008, ("14.6B", 64, 32): 2061.022,
    ("14.6B", 128, 16): 4175.516, ("14.6B", 128, 32): 4034.432,
    ("28.3B", 96, 32): 3171.569, ("28.3B", 96, 64): 2899.393,
    ("28.3B", 128, 32): 4075.091, ("28.3B", 128, 64): 3803.299,
    ("28.3B", 256, 32): 7715.640, ("28.3B", 256, 64): 7440.784,
}  # fmt: skip
LOOP_FAMILIES = ("1f1b", "zb-h1", "zb-h2")
# sail-sg's V-Half / V-Min (zbv_greedy.py), measured outside vpipe and replayed in vpipe's
# simulator: bubble by (P, M, costs, family), per V stage half a full stage's costs.
SAIL_SG_V = {
    (4, 12, "unit", "v-half"): 0.0649, (4, 12, "unit", "v-min"): 0.1325,
    (6, 18, "unit", "v-half"): 0.0924, (6, 18, "unit", "v-min"): 0.1360,
    (8, 24, "unit", "v-half"): 0.1056, (8, 24, "unit", "v-min"): 0.1579,
    (8, 24, "1.5B", "v-half"): 0.1702, (8, 24, "1.5B", "v-min"): 0.3353,
}  # fmt: skip


def _bubble(work: float, value: float) -> float:
    return 1.0 - work / value if value > 0 else 0.0


def _solver_available() -> bool:
    try:
        import ortools  # noqa: F401
    except ImportError:
        return False
    return True


def paper_rows(quick: bool, solver_time: float | None) -> list[str]:
    """Table 1 as text lines, and a count of the rows at or below sail-sg's heuristic."""
    from vpipe.schedules import make_schedule
    from vpipe.schedules.auto import auto_schedule
    from vpipe.sim import CostModel, simulate

    head = f"{'model':>5} {'P':>2} {'M':>3} {'limit':>5} {'auto':>7} {'auto s':>6} {'sail-sg':>7}"
    head += f" {'auto-sail':>9}" + "".join(f" {n:>7}" for n in LOOP_FAMILIES)
    if solver_time:
        head += f" {'solver':>7} {'bound':>7} {'gap':>6} {'solver s':>8}"
    lines, ties, below, total = [head], 0, 0, 0
    seen: set[str] = set()
    for (model, p, m), (f, b, w, c) in PAPER_COSTS.items():
        if quick and model in seen:
            continue
        seen.add(model)
        costs = CostModel(f=f, b=b, w=w, comm_latency=c)
        work = m * (f + b + w)
        for limit in (p, 2 * p):
            t0 = time.perf_counter()
            s = auto_schedule(p, m, costs, limit, "loop", objective="span")
            wall = time.perf_counter() - t0
            res = simulate(s, costs)
            assert max(res.peak_stage_activations) <= limit
            ref = SAIL_SG[model, m, limit]
            total += 1
            below += res.span < ref - 1e-3
            ties += abs(res.span - ref) <= 1e-3
            row = (
                f"{model:>5} {p:>2} {m:>3} {limit:>5} {_bubble(work, res.span):>7.4f} {wall:>6.2f}"
                f" {_bubble(work, ref):>7.4f} {res.span - ref:>+9.3f}"
            )
            for name in LOOP_FAMILIES:
                other = simulate(make_schedule(name, p, m), costs)
                fits = max(other.peak_stage_activations) <= limit
                row += f" {_bubble(work, other.span):>7.4f}" if fits else f" {'over':>7}"
            if solver_time and p == 8:
                ex = _exact(p, m, costs, limit, solver_time)
                row += (
                    f" {_bubble(work, ex['objective']):>7.4f} {_bubble(work, ex['bound']):>7.4f}"
                    f" {ex['gap']:>6.2%} {ex['wall_s']:>8.1f}"
                )
            lines.append(row)
    lines.append(
        f"auto at or below sail-sg's heuristic in {ties + below} of {total} rows "
        f"({below} below, {ties} equal within 0.001 ms; auto-sail: span difference, ms)"
    )
    return lines


def _exact(p: int, m: int, costs, limit: float, seconds: float) -> dict:
    from vpipe.schedules.auto import auto_schedule

    s = auto_schedule(p, m, costs, limit, "loop", objective="span", exact=True, time_limit=seconds)
    return s.meta["exact"]


def small_grid(quick: bool, solver_time: float) -> list[str]:
    """Table 2 as text lines: heuristic against the proven optimum."""
    from vpipe.schedules.auto import auto_schedule
    from vpipe.sim import CostModel

    f, b, w, c = PAPER_15B
    models = {"unit": CostModel(), "1.5B": CostModel(f=f, b=b, w=w, comm_latency=c)}
    shapes = [(2, 4), (4, 4), (4, 8)] if not quick else [(2, 4), (4, 8)]
    lines = [
        f"{'costs':>5} {'P':>2} {'M':>2} {'limit':>5} {'objective':>9} {'heuristic':>10} "
        f"{'optimum':>10} {'status':>8} {'heur/opt':>8} {'heur s':>7} {'solver s':>8}"
    ]
    worst = 0.0
    for label, costs in models.items():
        for p, m in shapes:
            for limit in (p, 2 * p):
                for objective in ("makespan", "span"):
                    t0 = time.perf_counter()
                    h = auto_schedule(p, m, costs, limit, "loop", objective=objective)
                    h_wall = time.perf_counter() - t0
                    s = auto_schedule(
                        p, m, costs, limit, "loop", objective=objective, exact=True,
                        time_limit=solver_time,
                    )  # fmt: skip
                    ex = s.meta["exact"]
                    ratio = h.meta["objective_value"] / ex["objective"] - 1
                    worst = max(worst, ratio) if ex["status"] == "optimal" else worst
                    lines.append(
                        f"{label:>5} {p:>2} {m:>2} {limit:>5} {objective:>9} "
                        f"{h.meta['objective_value']:>10.3f} {ex['objective']:>10.3f} "
                        f"{ex['status']:>8} {ratio:>8.2%} {h_wall:>7.2f} {ex['wall_s']:>8.2f}"
                    )
    lines.append(f"largest distance of the heuristic from a proven optimum: {worst:.2%}")
    return lines


def v_rows() -> list[str]:
    """Table 1b: ``v-half`` and ``v-min`` by name, built for the costs, against the block-built
    V-Half/V-Min and sail-sg's, objective span."""
    from vpipe.schedules import make_schedule
    from vpipe.schedules.controllable import v_half, v_min
    from vpipe.sim import CostModel, simulate

    block_built = {"v-half": v_half, "v-min": v_min}
    lines = [
        f"{'P':>2} {'M':>3} {'costs':>5} {'family':>7} {'by name':>8} {'peak':>5} "
        f"{'block':>7} {'peak':>5} {'sail-sg':>8} {'s':>5}"
    ]
    for (p, m, model, family), ref in SAIL_SG_V.items():
        f, b, w, c = (1.0, 1.0, 1.0, 0.0) if model == "unit" else PAPER_15B
        costs = CostModel(f=f, b=b, w=w, comm_latency=c, unit="rank")  # each V stage: half
        work = m * (f + b + w)
        t0 = time.perf_counter()
        s = make_schedule(family, p, m, costs=costs)
        wall = time.perf_counter() - t0
        res = simulate(s, costs)
        block = simulate(block_built[family](p, m), costs)
        lines.append(
            f"{p:>2} {m:>3} {model:>5} {family:>7} {_bubble(work, res.span):>8.4f} "
            f"{max(res.peak_stage_activations) / 2:>5g} {_bubble(work, block.span):>7.4f} "
            f"{max(block.peak_stage_activations) / 2:>5g} {ref:>8.4f} {wall:>5.1f}"
        )
    return lines


def large_timing() -> list[str]:
    """Table 3: the heuristic's wall time at P = 32, M = 256 (the 28.3B costs) on each
    placement and limit (a V stage costs half a full stage)."""
    from vpipe.schedules.auto import auto_schedule
    from vpipe.sim import CostModel

    f, b, w, c = PAPER_COSTS["28.3B", 32, 256]
    lines = []
    for placement, spr in (("loop", 1), ("v", 2)):
        costs = CostModel(f=f / spr, b=b / spr, w=w / spr, comm_latency=c)
        for limit in (32, 64):
            t0 = time.perf_counter()
            s = auto_schedule(32, 256, costs, limit, placement, objective="span")
            wall = time.perf_counter() - t0
            lines.append(
                f"P=32 M=256 {placement:>4} limit {limit}: {wall:.2f} s, span "
                f"{s.meta['objective_value']:.1f}"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scheduler_quality", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="each model's first M only, a smaller grid")
    ap.add_argument("--solver-time", type=float, default=60.0, help="per solve (default 60 s)")
    ap.add_argument("--no-solver", action="store_true", help="skip the exact solver")
    ap.add_argument("--paper-solver", action="store_true",
                    help="also run the solver on the 1.5B rows (P = 8: bounds, not proofs)")  # fmt: skip
    args = ap.parse_args(argv)
    solver = not args.no_solver and _solver_available()
    print("1. the paper's four models (Table 9 costs), loop placement, strict count, span: bubble")
    paper_time = args.solver_time if solver and args.paper_solver else None
    print("\n".join(paper_rows(args.quick, paper_time)))
    print()
    print("1b. v-half and v-min by name, built for the costs, at their memory, span: bubble")
    print("\n".join(v_rows()))
    print()
    if solver:
        print("2. small pipelines: heuristic vs the solver's optimum (loop placement)")
        print("\n".join(small_grid(args.quick, args.solver_time)))
    else:
        print("2. skipped: no solver (pip install 'vpipe[solver]')")
    print()
    print("3. heuristic wall time")
    print("\n".join(large_timing()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
