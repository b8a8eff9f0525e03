"""Predictions carry their measured error: the held-out cells of a fidelity table's row
(:mod:`vpipe.predict.fidelity`), the error across microbatch counts, the plan's tie band and
intervals from them, and recommendations at the microbatch counts a sweep measured."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from vpipe.predict.fidelity import MeasuredError, held_out_error, interval_text
from vpipe.predict.fidelity_runs import PlanErrors, across_m_table, plan_errors
from vpipe.predict.plan import Budget, Candidate, recommend
from vpipe.predict.plan_error import alternative_note, tie_band, with_errors

TABLE = pd.DataFrame(
    {
        "calibrated on": ["1f1b", "zb-h1", "zbv"],
        "1f1b": [0.238, 0.266, 0.038],
        "zb-h1": [0.159, 0.125, -0.080],
        "zbv": [0.131, -0.055, -0.201],
        "dualpipev": [0.174, float("nan"), -0.015],
    }
)


def test_the_error_is_the_largest_held_out_cell_of_the_calibration_row():
    # zbv's row: 1f1b +3.8%, zb-h1 -8.0%, dualpipev -1.5%; its own -20.1% is in sample
    e = held_out_error(TABLE, "zbv", "vpipe M=6, calibrated on zbv")
    assert e.value == pytest.approx(0.080) and e.cells == 3
    assert e.words() == (
        "±8.0% (the largest |error| of 3 held-out predictions, vpipe M=6, calibrated on zbv)"
    )
    assert held_out_error(TABLE, "1f1b").value == pytest.approx(0.174)
    # zb-h1 did not predict dualpipev (NaN): two cells, 1f1b's +26.6% the largest
    e = held_out_error(TABLE, "zb-h1")
    assert (e.value, e.cells) == (pytest.approx(0.266), 2)


def test_too_few_held_out_configs_leave_the_error_unknown_in_words():
    assert held_out_error(None, "zbv").words() == "error unknown: one config measured"
    two = TABLE[["calibrated on", "1f1b", "zbv"]].iloc[[0, 2]]  # two configs: one held out
    e = held_out_error(two, "zbv")
    assert not e.known and e.value is None
    assert e.words() == "error unknown: two configs measured, 1 held out (2 needed)"
    assert "not a calibration config" in held_out_error(TABLE, "dualpipev").words()


def test_a_predicted_step_reads_with_its_interval():
    assert interval_text(0.2766, MeasuredError(0.03)) == "276.60 ± 8.30 ms"
    assert interval_text(0.2766, MeasuredError(None), unit="") == "276.60 (error unknown)"


def test_the_tie_band_is_the_measured_error_unless_given_or_unknown():
    known = PlanErrors(MeasuredError(0.083, 4), MeasuredError(None, why="x"), (6,))
    assert tie_band(known, None) == (0.083, "the error measured on the sweep")
    assert tie_band(known, 0.02) == (0.02, "--tie, yours")
    none = PlanErrors(MeasuredError(None, why="x"), MeasuredError(None, why="x"))
    assert tie_band(none, None) == (0.05, "the default band, the error being unknown")


def _c(schedule: str, step_ms: float, m: int, peak: float = 2**20) -> Candidate:
    return Candidate(schedule, 1, m, step_ms / 1e3, 1.0, 0.1, [peak], [1.0])


def test_the_recommendation_is_made_at_a_measured_microbatch_count_first():
    # zb-h1 at M=16 (never measured) is predicted fastest; at the measured M=6, zbv
    found = [_c("zb-h1", 90.0, 16), _c("zbv", 100.0, 6), _c("1f1b", 130.0, 6)]
    assert recommend(found, Budget(2**30)).microbatches == 16
    assert recommend(found, Budget(2**30), measured_m=[6]).schedule == "zbv"
    # nothing at a measured M fits: the extrapolated candidates are all there is
    found = [_c("zb-h1", 90.0, 16, 2**20), _c("zbv", 100.0, 6, 2**30)]
    assert recommend(found, Budget(2**21), measured_m=[6]).schedule == "zb-h1"


def _result(alt_ms: float, rec_ms: float = 100.0) -> dict:
    rec = _c("zbv", rec_ms, 6).to_dict()
    alt = _c("zb-h1", alt_ms, 16).to_dict()
    return {"recommended": rec, "candidates": [alt, rec], "tied": [rec], "measured_m": [6]}


@pytest.mark.parametrize(
    ("alt_ms", "e_x", "shown"),
    [
        (80.0, 0.10, True),  # 80 * 1.10 = 88 < 100 * 0.95: faster by more than both errors
        (90.0, 0.10, False),  # 99 > 95: within the errors
        (80.0, None, False),  # the error across M is unknown: nothing to beat
    ],
)
def test_an_extrapolated_alternative_shows_only_beyond_both_errors(alt_ms, e_x, shown):
    errors = PlanErrors(MeasuredError(0.05, 3), MeasuredError(e_x, 4, why="not measured"), (6,))
    result = with_errors(_result(alt_ms), errors, "the error measured on the sweep")
    assert (result["alternative"] is not None) == shown
    rec, alt = result["recommended"], result["candidates"][0]
    assert rec["m_measured"] and rec["error"] == 0.05
    assert alt["m_measured"] is False and alt["error"] == e_x
    assert result["error"] == 0.05 and result["error_source"].startswith("±5.0%")
    note = alternative_note(result)
    assert ("zb-h1 v1 M16" in note and "more than both errors" in note) == shown


def test_the_error_across_microbatch_counts_is_exact_on_traces_with_known_costs():
    """Traces simulated at M=4 and M=8 from per-row costs (a model of 4 pieces, batch 32):
    calibrated at one M, the plan's rescaling predicts the other M exactly; a wrong timed
    median shows up as that config's error."""
    from vpipe.schedules import make_schedule
    from vpipe.sim import CostModel, simulate

    runs, events = [], {}
    for name in ("1f1b", "zb-h1", "zbv"):
        for m in (4, 8):
            s = make_schedule(name, 2, m)
            k = 4 // s.n_stages * 8 / m  # pieces per stage x rows per microbatch (per 4 rows)
            cm = CostModel(per_stage={i: {"f": 300.0 * k, "b": 200.0 * k, "w": 200.0 * k}
                                      for i in range(s.n_stages)})  # fmt: skip
            sim = simulate(s, cm)
            rid = f"{name}-m{m}"
            events[rid] = sim.to_events(rid, s, time_unit_ns=1000)
            runs.append({"run_id": rid, "schedule": name, "microbatches": m, "impl": "vpipe",
                         "step_time_s": sim.makespan * 1e-6})  # fmt: skip
    runs = pd.DataFrame(runs)
    meta = {"model": "mlp", "sizes": {"n_blocks": 4}, "batch": 32}
    sources = [r for r in runs.itertuples() if r.run_id == "zbv-m4"]
    table = across_m_table(runs, events.get, 2, meta, sources)
    assert list(table.columns) == ["calibrated on", "1f1b M=8", "zb-h1 M=8", "zbv M=8"]
    assert table["calibrated on"].tolist() == ["zbv M=4"]
    assert (table.drop(columns="calibrated on").abs() < 1e-9).all().all(), table
    # the plan's errors from the same runs: exact at M=4 (two held out) and across M
    errors = plan_errors(runs, events.get, sources[0], 2, meta)
    assert errors.measured_m == (4, 8)
    assert errors.measured.value == pytest.approx(0, abs=1e-9) and errors.measured.cells == 2
    assert errors.extrapolated.value == pytest.approx(0, abs=1e-9)
    assert errors.extrapolated.cells == 3
    runs.loc[runs["run_id"] == "1f1b-m8", "step_time_s"] *= 1.25
    wider = plan_errors(runs, events.get, sources[0], 2, meta)
    assert wider.extrapolated.value == pytest.approx(0.2) and wider.measured.value < 1e-9
    bad = across_m_table(runs, events.get, 2, meta, sources)
    assert math.isclose(bad["1f1b M=8"].iloc[0], 1 / 1.25 - 1, abs_tol=1e-9)
    assert across_m_table(runs[runs["microbatches"] == 4], events.get, 2, meta, sources) is None


# A stored sweep (5 schedules, M=8, both implementations), read back once for the module.
BASELINE = Path(__file__).parent.parent / "results" / "baseline"
ZBV = "20261204T224754-28920-zbv-m8-vpipe"


@pytest.fixture(scope="module")
def baseline():
    from vpipe.sweep.stored import load_bench
    from vpipe.sweep.write import fidelity_tables

    res = load_bench(BASELINE)
    fidelity = fidelity_tables(res)
    loo = next(t for impl, m, t in fidelity if impl == "vpipe" and m == 8)
    row = loo.set_index("calibrated on").loc["zbv"].drop("zbv")
    return res, fidelity, float(row.abs().max())


def test_the_bench_reports_plan_states_the_error_it_measured(baseline):
    from report_reader import contradictions, table

    from vpipe.sweep.plan_section import plan_sections
    from vpipe.sweep.write import fidelity_sections

    res, fidelity, worst_zbv = baseline
    (section,) = plan_sections(res, fidelity)
    text = section.markdown
    error = f"{worst_zbv:.1%}"
    assert (f"Predicted step times: ±{error} (the largest |error| of 4 held-out predictions, "
            "vpipe M=8, calibrated on zbv).") in text  # fmt: skip
    assert f"within {error} of the fastest (the error measured on the sweep)" in text
    assert "and 8 microbatches" in text.split("Recommended:")[1].split(",")[0]
    assert ("extrapolated rows: error unknown: not measured at this M (the sweep ran M=8 "
            "only)") in text  # fmt: skip
    # the zbv calibration, anchored, errs up to 11.5% on this sweep: within that band the tie
    # rule picks the simplest, and the plan says the measured verdict (zb-h1) is faster
    assert ("The verdict at M=8 runs zb-h1 (measured); the plan picks 1f1b v1 M8: it predicts "
            "zb-h1 -7.2% against it, within its tie band") in text  # fmt: skip
    assert "measured, zb-h1 is faster: run it." in text
    rows = table(text)
    for r in rows:
        step = r["predicted step ms"]
        if r["M measured"] == "yes":
            ms, half = (float(x) for x in step.split(" ± "))
            assert half == pytest.approx(ms * worst_zbv, abs=0.01)
        else:
            assert step.endswith(" (error unknown)")
    assert {r["M measured"] for r in rows} == {"yes", "extrapolated"}
    md = "\n\n".join(f"## {s.title}\n\n{s.markdown}"
                     for s in [*fidelity_sections(res, fidelity), section])  # fmt: skip
    assert contradictions(md) == []


def test_a_plan_that_differs_from_the_verdict_says_why(baseline):
    """zb-h1 is the verdict at M=8 (every other schedule measured slower)."""
    import dataclasses

    from vpipe.sweep.plan_section import verdict_agreement

    res = baseline[0]

    def cand(schedule, v, ms):
        return {"schedule": schedule, "stages_per_rank": v, "microbatches": 8,
                "predicted_step_s": ms / 1e3, "recompute": "none"}  # fmt: skip

    zbv, zbh1, auto = cand("zbv", 2, 100.0), cand("zb-h1", 1, 103.0), cand("auto", 1, 99.0)
    head = "The verdict at M=8 runs zb-h1 (measured); the plan picks "
    said = verdict_agreement(res, {"recommended": zbv, "tied": [zbv, zbh1],
                                   "candidates": [zbv, zbh1]})  # fmt: skip
    assert said == (f"{head}zbv v2 M8: it predicts zb-h1 +3.0% against it, within its tie "
                    "band, and its tie rule picked zbv v2 M8; measured, zb-h1 is faster: run it.")  # fmt: skip
    said = verdict_agreement(res, {"recommended": zbv, "tied": [zbv], "candidates": [zbv, zbh1]})
    assert said.startswith(f"{head}zbv v2 M8: it predicts zb-h1 3.0% slower, beyond its tie band")
    said = verdict_agreement(res, {"recommended": auto, "tied": [auto], "candidates": [auto]})
    assert (
        said
        == f"{head}auto v1 M8, a config the sweep did not run: measure it before preferring it."
    )
    # zbv measured as fast as zb-h1 (the same steps): a measured tie
    steps = res.steps.copy()
    mine = (steps["impl"] == "vpipe") & (steps["schedule"] == "zbv")
    theirs = steps[(steps["impl"] == "vpipe") & (steps["schedule"] == "zb-h1")]
    steps.loc[mine, "step_time_s"] = theirs["step_time_s"].to_numpy()
    tie = dataclasses.replace(res, steps=steps)
    said = verdict_agreement(tie, {"recommended": zbv, "tied": [zbv], "candidates": [zbv]})
    assert "which the sweep measured as tied with it" in said


def test_plan_from_a_stored_sweep_carries_its_error(capsys, baseline):
    import json

    from vpipe.cli import main

    worst_zbv = baseline[2]
    argv = ["plan", "-p", "2", "--batch", "512", "--memory", "10MiB", "--from", str(BASELINE),
            "--run", ZBV, "--top", "40"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["error"] == pytest.approx(worst_zbv) and out["tie"] == pytest.approx(worst_zbv)
    assert out["error_source"].startswith(f"±{worst_zbv:.1%} (the largest |error| of 4 held-out")
    assert out["tie_source"] == "the error measured on the sweep"
    assert out["extrapolated_error"] is None and out["alternative"] is None
    assert out["extrapolated_error_source"] == (
        "error unknown: not measured at this M (the sweep ran M=8 only)"
    )
    assert out["measured_m"] == [8] and out["recommended"]["microbatches"] == 8
    for c in out["candidates"]:
        assert c["m_measured"] == (c["microbatches"] == 8)
        assert c["error"] == (pytest.approx(worst_zbv) if c["m_measured"] else None)
    assert main(argv) == 0
    text = capsys.readouterr().out
    rec = out["recommended"]
    half = rec["predicted_step_s"] * worst_zbv * 1e3
    assert f"{rec['predicted_step_s'] * 1e3:.2f} ± {half:.2f} ms per step (predicted" in text
    assert f"tie band {worst_zbv:.1%} (the error measured on the sweep)" in text
    assert "extrapolated M (not measured by the sweep: M=8): error unknown: not measured" in text
    assert main([*argv, "--tie", "0.2"]) == 0
    assert "tie band 20.0% (--tie, yours)" in capsys.readouterr().out


def test_report_and_analyze_of_a_stored_sweep_state_the_error(tmp_path, capsys, baseline):
    from vpipe.cli import main

    worst_zbv = baseline[2]
    assert main(["report", str(BASELINE), "-o", str(tmp_path / "r.html")]) == 0
    md = (tmp_path / "r.md").read_text()
    assert "## Simulator fidelity (vpipe, M=8)" in md and "## Plan for this host" in md
    assert "The timed ratios these errors are judged against are known to +-" in md
    assert f"Predicted step times: ±{worst_zbv:.1%} (the largest |error|" in md
    capsys.readouterr()
    assert main(["analyze", str(BASELINE), "--run", ZBV, "--predict", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert f"predicted step times: ±{worst_zbv:.1%} (the largest |error| of 4 held-out" in out


def test_a_stored_output_reads_back_as_its_last_sweep(tmp_path):
    """``--append`` keeps earlier sweeps' runs in the store; ``meta.json`` and the steps are the
    last sweep's, so only its runs are read back."""
    import json
    import shutil

    from vpipe.sweep.stored import load_bench

    assert load_bench(tmp_path) is None  # not a bench output
    copy = tmp_path / "out"
    shutil.copytree(BASELINE, copy)
    res = load_bench(copy)
    measured = res.measured
    assert len(measured) == 10 and set(res.events) == set(measured["run_id"])
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "bench_id": "a-later-sweep"}))
    assert load_bench(copy).runs.empty
    (copy / "meta.json").write_text("{broken")  # refused in one line naming the file
    from vpipe.errors import VpipeError

    with pytest.raises(VpipeError, match=r"meta\.json: unreadable"):
        load_bench(copy)
