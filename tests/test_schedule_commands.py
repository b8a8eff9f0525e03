"""Every command of the schedule group, driven over random families, sizes, stages per rank,
costs and memory limits in one process: each prints its answer or refuses in one line, never
a traceback; a grid that ``show`` prints holds every action of its schedule in program order.

The same commands over the whole catalogue at P <= 8 are ``python -m bench.show_grid``.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.show_grid import grid_problems, run_cli
from vpipe.ir import Schedule
from vpipe.schedules import schedule_names

NAMES = sorted(schedule_names())


@st.composite
def cost_spec(draw) -> str:
    f, b, w = (draw(st.integers(1, 4)) for _ in range(3))
    spec = f"f={f},b={b},w={w}"
    if draw(st.booleans()):
        spec += f",comm={draw(st.sampled_from([0, 0.5, 1]))}"
    return spec


@st.composite
def invocation(draw) -> tuple[list[str], str]:
    """(argv, kind): one command line of the schedule group with random arguments, some of
    them out of range (a V a family does not take, a limit nothing fits)."""
    kind = draw(st.sampled_from(["show", "lowered", "simulate", "validate", "compare", "plan"]))
    name = draw(st.sampled_from(NAMES))
    p, m = draw(st.integers(1, 5)), draw(st.integers(1, 10))
    sizes = ["-p", str(p), "-m", str(m)]
    if draw(st.integers(0, 4)) == 0:
        sizes += ["-v", str(draw(st.integers(1, 3)))]
    cost = ["--cost", draw(cost_spec())] if draw(st.booleans()) else []
    if kind == "compare":
        chosen = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
        return ["compare", *sizes, "--schedules", ",".join(chosen), *cost], kind
    if kind == "plan":
        memory = f"{draw(st.integers(1, 3 * p))}units"
        argv = ["plan", "--ranks", str(p), "--batch", str(2 * m), "-m", str(m),
                "--memory", memory, "--cost", draw(cost_spec()), "--schedules", name]  # fmt: skip
        return argv, kind
    argv = [name, *sizes, *cost]
    if name == "auto" and draw(st.booleans()):
        argv += ["--memory", f"{draw(st.integers(1, 3 * p))}units"]
        argv += ["--placement", draw(st.sampled_from(["v", "loop", "interleaved"]))]
    if kind == "simulate":
        return ["simulate", *argv], kind
    return ["show", *argv, *(["--lowered"] if kind == "lowered" else [])], kind


def _one_line_refusal(rc: int, out: str, err: str) -> bool:
    return rc != 0 and err.count("\n") == 1 and "error" in err and "Traceback" not in err


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(invocation())
def test_every_schedule_command_answers_or_refuses_in_one_line(tmp_path_factory, case):
    argv, kind = case
    csv = str(tmp_path_factory.mktemp("cmd") / "s.csv")
    if kind in ("show", "lowered", "validate"):
        argv = [*argv, "--csv", csv, "--width", "1000000"]
    rc, out, err = run_cli(argv)
    if rc != 0:
        assert _one_line_refusal(rc, out, err), (argv, err)
        return
    assert out.strip() and err == "", (argv, err)
    if kind in ("show", "lowered"):
        written = Schedule.from_csv(csv)
        assert grid_problems(out, written, kind == "lowered") == [], argv
    if kind == "validate":  # the CSV that show wrote, validated
        rc, out, err = run_cli(["validate", csv])
        assert rc == 0 and out.startswith("valid: ") and err == "", (argv, err)
        assert Path(csv).stat().st_size > 0


PAPER_15B = "f=18.522,b=18.086,w=9.337,comm=0.601"


def test_cost_adapted_names_follow_the_costs_in_every_command(tmp_path):
    """v-half, v-min and auto are built for the command's --cost in show, simulate and compare
    (as make_schedule(..., costs=...) builds them), and for unit costs without it."""
    from vpipe.schedules import make_schedule
    from vpipe.sim import CostModel, simulate

    costs = CostModel.parse(PAPER_15B)
    p, m = 6, 12
    rc, out, _ = run_cli(["compare", "-p", str(p), "-m", str(m), "--cost", PAPER_15B,
                          "--schedules", "v-half,v-min,auto", "--json"])  # fmt: skip
    assert rc == 0
    rows = {r["schedule"]: r for r in json.loads(out)["schedules"]}
    differs = 0
    for name in ("v-half", "v-min", "auto"):
        adapted = make_schedule(name, p, m, costs=costs)
        unit = make_schedule(name, p, m)
        differs += adapted.actions != unit.actions
        assert rows[name]["makespan"] == simulate(adapted, costs).makespan
        csv = tmp_path / f"{name}.csv"
        rc, out, _ = run_cli(["show", name, "-p", str(p), "-m", str(m), "--cost", PAPER_15B,
                              "--csv", str(csv)])  # fmt: skip
        assert rc == 0 and f"{name} chose" in out
        assert Schedule.from_csv(csv).actions == adapted.actions
        rc, out, _ = run_cli(["show", name, "-p", str(p), "-m", str(m), "--csv", str(csv)])
        assert rc == 0 and Schedule.from_csv(csv).actions == unit.actions
        rc, out, _ = run_cli(["simulate", name, "-p", str(p), "-m", str(m), "--cost", PAPER_15B])
        assert rc == 0 and f"makespan       {simulate(adapted, costs).makespan:g}" in out
    assert differs, "the paper's costs should change at least one of the three schedules"
