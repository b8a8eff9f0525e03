"""One cost convention: the same cost string gives the same makespan and peak in `vpipe
simulate`, `vpipe compare` and the Python API, and a unit mismatch is refused with the
conversion spelled out."""

from __future__ import annotations

import json

import pytest

from vpipe import CostModel, make_schedule, simulate
from vpipe.cli import main
from vpipe.sim.cost_model import CostModelError

COST = "f=2,b=2,w=1,comm=0.5,act_bytes=1"  # act_bytes=1: peak bytes = peak in rank shares


def _cli_json(argv, capsys):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", ["zbv", "interleaved-1f1b", "1f1b", "dualpipev"])
def test_same_cost_string_same_makespan_and_peak_everywhere(name, capsys):
    p, m = 4, 8
    sim = _cli_json(["simulate", name, "-p", str(p), "-m", str(m), "--cost", COST, "--json"],
                    capsys)  # fmt: skip
    cmp_ = _cli_json(["compare", "--schedules", name, "-p", str(p), "-m", str(m), "--cost", COST,
                      "--json"], capsys)["schedules"][0]  # fmt: skip
    schedule = make_schedule(name, p, m)
    api = simulate(schedule, CostModel.parse(COST))
    api_text = simulate(schedule, COST)
    assert sim["makespan"] == cmp_["makespan"] == api.makespan == api_text.makespan
    peak = max(api.peak_activation_bytes)
    assert max(sim["peak_activation_bytes"]) == cmp_["peak_activation_units_max"] == peak
    # per stage, written out: the same numbers
    v = schedule.stages_per_rank
    per_stage = CostModel(f=2 / v, b=2 / v, w=1 / v, comm_latency=0.5, activation_bytes=1 / v)
    assert simulate(schedule, per_stage).makespan == api.makespan


def test_zbv_figures_of_the_issue(capsys):
    """The issue's example: zbv at P=4, M=8 gave 94 in simulate (per stage) and 51.5 in compare
    (per rank's share); now both read the string per rank's share, and unit=stage says 94."""
    argv = ["simulate", "zbv", "-p", "4", "-m", "8", "--json", "--cost"]
    assert _cli_json([*argv, "f=2,b=2,w=1,comm=0.5"], capsys)["makespan"] == 51.5
    assert _cli_json([*argv, "f=2,b=2,w=1,comm=0.5,unit=stage"], capsys)["makespan"] == 94


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--cost", "f=2,b=1,w=1,unit=stage"], "f=2 per stage at V=2 is f=4 per rank"),
        (["simulate", "zbv", "--cost", "f=1,rows=8"], "rows= is vpipe plan's key"),
        (
            [
                "plan",
                "-p",
                "2",
                "--batch",
                "8",
                "--memory",
                "9units",
                "--cost",
                "f=1,b=1,w=1,unit=stage",
            ],
            "multiply per-stage f, b, w and act_bytes",
        ),
        (["simulate", "zbv", "--cost", "f=1,unit=layer"], "unit is 'rank' or 'stage'"),
    ],
)
def test_unit_mismatch_is_refused_with_the_conversion(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_python_models_say_their_unit():
    assert CostModel().unit == "stage" and CostModel.parse("").unit == "rank"
    with pytest.raises(CostModelError, match="unit must be"):
        CostModel(unit="layer")
    half = CostModel.parse("f=2,b=4,w=6,act_bytes=8").for_schedule(2)
    assert (half.f, half.b, half.w, half.activation_bytes, half.unit) == (1, 2, 3, 4, "stage")
