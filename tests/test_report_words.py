"""Report and command wording that must not contradict the figures beside it: a winner only
when every config says so, the launch spread's floor said as a floor, one wording of a bad
count for every command, compare's step-time ratio named as such."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from vpipe.cli import main
from vpipe.report.crossrun_table import headline, run_to_run_sd


def _row(schedule: str, verdict: str, settle: str = "") -> dict:
    return {"schedule": schedule, "M": 8, "impl": "vpipe", "run": "b", "speedup": "1.10",
            "95% CI": "1.05-1.15", "verdict": verdict, "to settle": settle}  # fmt: skip


def test_one_faster_config_among_inconclusive_ones_is_no_winner():
    table = pd.DataFrame([_row("zbv", "faster")]
                         + [_row(s, "inconclusive", "more blocks per run (--blocks 5)")
                            for s in ("1f1b", "zb-h1")])  # fmt: skip
    line = headline(table, "a", "speedup")
    assert line.startswith("no winner over all configs: b faster than a in 1 of 3 configs"), line
    assert "; 2 inconclusive; to settle: more blocks per run (--blocks 5)" in line
    every = pd.DataFrame([_row(s, "faster") for s in ("zbv", "1f1b")])
    assert headline(every, "a", "speedup").startswith("winner: b, faster than a in 2 of 2 configs")


def test_a_launch_spread_under_the_floor_is_said_to_be_replaced_by_it():
    rng = np.random.default_rng(0)
    steps = pd.DataFrame(
        [dict(schedule="zbv", microbatches=8, impl="vpipe", block=b, round=b, step=k,
              step_time_s=0.1 * (1 + 0.001 * rng.standard_normal())) for b in range(3)
         for k in range(9)]
    )  # fmt: skip
    spread = run_to_run_sd([steps], normalise=False)
    assert spread.sd == 0.03 and "(the default floor)" not in spread.source
    assert "under the floor (0.030, measured by bench.false_alarms), so the floor is used" in spread.source


def test_a_count_of_zero_is_worded_alike_by_show_and_run(capsys):
    lines = []
    for command in ("show", "run"):
        with pytest.raises(SystemExit) as stop:
            main([command, "zbv", "-p", "0", "-m", "4"])
        assert stop.value.code == 2
        lines.append(capsys.readouterr().err.split(": error: ", 1)[1])
    assert lines[0] == lines[1] == "argument --ranks/-p: expected a positive integer, got '0' (see --help)\n"


def test_compare_names_its_ratio_a_step_time_ratio(capsys):
    assert main(["compare", "-p", "2", "-m", "4"]) == 0
    out = capsys.readouterr().out
    assert "step vs interleaved-1f1b" in out.splitlines()[1]
    assert "step vs interleaved-1f1b: makespan over interleaved-1f1b's, lower is faster" in out
