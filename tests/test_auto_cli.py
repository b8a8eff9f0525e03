"""``vpipe show auto`` and ``vpipe simulate`` with auto's flags and ``--objective``."""

from __future__ import annotations

import json

import pytest

from vpipe.cli import main
from vpipe.ir import Schedule
from vpipe.ir.lowering import lower, validate
from vpipe.sim import CostModel, simulate

PAPER = "f=18.522,b=18.086,w=9.337,comm=0.601"


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_show_auto_writes_the_schedule_auto_chose(tmp_path, capsys):
    path = tmp_path / "auto.csv"
    rc, out, _ = run(
        ["show", "auto", "-p", "4", "-m", "8", "--cost", PAPER, "--memory", "8units",
         "--placement", "loop", "--objective", "span", "--csv", str(path), "--width", "80"],
        capsys,
    )  # fmt: skip
    assert rc == 0 and "by span" in out and "under memory limit 8" in out
    s = Schedule.from_csv(path, n_ranks=4)
    validate(lower(s))
    costs = CostModel(f=18.522, b=18.086, w=9.337, comm_latency=0.601)
    res = simulate(s, costs)
    assert max(res.peak_stage_activations) <= 8
    value = float(out.split("by span ")[1].split()[0])
    assert res.span == pytest.approx(value, rel=1e-5)


def test_simulate_reports_the_objective(capsys):
    rc, out, _ = run(
        ["simulate", "auto", "-p", "4", "-m", "8", "--cost", PAPER, "--placement", "loop",
         "--memory", "4units", "--objective", "span", "--json"],
        capsys,
    )  # fmt: skip
    assert rc == 0
    got = json.loads(out)
    assert got["objective"] == "span" and got["objective_value"] == got["span"]
    assert max(got["peak_activation_units"]) <= 4
    # costs per stage (the unit=stage reading): one slot per F, I, W of a stage
    rc, out, _ = run(
        ["simulate", "zbv", "-p", "2", "-m", "4", "--cost", "f=1,b=1,w=1,comm=0,unit=stage"], capsys
    )
    assert rc == 0 and "objective      makespan = 25" in out and "span           24 " in out


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--memory", "0.5units"], "smallest feasible limit is 1"),
        (["--memory", "3GiB"], "needs act_bytes="),
        (["--i-frees", "2"], "--i-frees must be between 0 and 1"),
    ],
)
def test_bad_auto_flags_are_one_line_errors(extra, needle, capsys):
    rc, _, err = run(["show", "auto", "-p", "4", "-m", "8", *extra], capsys)
    assert rc != 0 and needle in err and len(err.strip().splitlines()) == 1


def test_a_limit_in_bytes_with_activation_bytes(capsys):
    rc, out, _ = run(
        ["show", "auto", "-p", "2", "-m", "4", "--cost", "f=1,b=1,w=1,act_bytes=1000",
         "--memory", "2000", "--i-frees", "0.5", "--width", "80"],
        capsys,
    )  # fmt: skip
    assert rc == 0 and "under memory limit 2000" in out
