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


def test_the_setup_table_says_which_steps_rounds_and_blocks_and_no_null():
    from vpipe.report.document import meta_table

    meta = {"commit": None, "dtype": None, "post_thread": None, "steps": 3, "rounds": 3,
            "rounds_run": 10, "blocks": 1, "sizes": {"n_blocks": 8}}  # fmt: skip
    table = meta_table(meta)
    assert "null" not in set(table["value"])
    assert list(table["field"]) == [
        "commit", "dtype", "post_thread", "steps per round (--steps)", "rounds asked (--rounds)",
        "rounds run", "blocks (--blocks)", "model sizes (--sizes)",
    ]  # fmt: skip
    means = dict(zip(table["field"], table["means"], strict=True))
    assert "not the model's n_blocks" in means["blocks (--blocks)"]
    assert "not launch blocks" in means["model sizes (--sizes)"]


def test_memory_is_saved_activations_and_the_allocator_peak_in_columns_of_their_own():
    from vpipe.report.document import summary_table, v_vs_baseline

    runs = pd.DataFrame(
        [dict(schedule=s, microbatches=8, impl="vpipe", step_time_s=t, samples_per_s=1 / t,
              peak_memory_bytes=saved, peak_saved_activations_bytes=saved,
              peak_cuda_peak_bytes=cuda) for s, t, saved, cuda in
         (("interleaved-1f1b", 0.1, 8 * 2**20, 40 * 2**20), ("zbv", 0.09, 6 * 2**20, 30 * 2**20))]
    )  # fmt: skip
    table = summary_table(runs)
    assert "peak MiB" not in table.columns
    assert list(table["saved activations MiB"]) == ["8.00", "6.00"]
    assert list(table["allocator peak MiB"]) == ["40.00", "30.00"]
    cpu = summary_table(runs.assign(peak_cuda_peak_bytes=None))
    assert "allocator peak MiB" not in cpu.columns and "saved activations MiB" in cpu.columns
    steps = pd.DataFrame([dict(schedule=s, microbatches=8, impl="vpipe", round=r, step=0,
                               step_time_s=t) for s, t in (("interleaved-1f1b", 0.1), ("zbv", 0.09))
                          for r in range(6)])  # fmt: skip
    vv = v_vs_baseline(runs, steps)
    assert {"saved activations MiB", "interleaved-1f1b saved activations MiB"} <= set(vv.columns)
