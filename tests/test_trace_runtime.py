"""A real profiled 2-rank sweep (vpipe's runtime, gloo, one launch for several schedules, two
interleaved profile rounds) converts to exactly one compute row per executed action per
profiled step, with the right rank, stage, microbatch and kind; the comm actions and waits show
up too, and the store holds every run with its metrics."""

import re

import pytest

from vpipe.ir.lowering import lower
from vpipe.schedules import make_schedule
from vpipe.sweep.driver import Config, SweepSpec, run_sweep
from vpipe.sweep.results import collect
from vpipe.sweep.write import write_outputs
from vpipe.trace.store import Store

SCHEDULES = ["1f1b", "zbv", "dualpipev"]
BENCH_ID = "prof"


@pytest.fixture(scope="module")
def profiled():
    spec = SweepSpec(
        ranks=2, sizes={"d_model": 16, "d_hidden": 32, "n_blocks": 4}, batch=8,
        schedules=tuple(SCHEDULES), microbatches=(4,), impls=("vpipe",),
        warmup=1, steps=1, rounds=1, profile_steps=2, progress=False,
    )  # fmt: skip
    spec.validate()
    return spec, collect(spec, run_sweep(spec, BENCH_ID), BENCH_ID, 0.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_compute_row_per_executed_action(profiled, schedule):
    spec, res = profiled
    events = res.events[Config(schedule, 4, "vpipe").run_id(BENCH_ID)]
    assert set(events["schedule"]) == {schedule} and set(events["rank"]) == {0, 1}
    steps = sorted(set(events["step"]))
    assert steps == list(range(spec.profile_steps))  # one profiled step per round, by round
    programs = lower(make_schedule(schedule, 2, 4)).actions
    for rank in (0, 1):
        program = programs[rank]
        want = sorted(
            (p.kind.value, p.stage, p.microbatch)
            for a in program
            if a.is_compute
            for p in a.compute_parts()
        )
        comm = [(a.kind.value, a.stage, a.microbatch) for a in program if a.is_comm]
        for step in steps:
            ev = events[(events["rank"] == rank) & (events["step"] == step)]
            got = ev[ev["kind"].isin(["F", "B", "I", "W"])]
            assert (
                sorted(zip(got["kind"].astype(str), got["stage"], got["microbatch"], strict=True))
                == want
            )
            got_comm = ev[ev["kind"].astype(str).str.contains("SEND|RECV")]
            assert (
                list(
                    zip(
                        got_comm["kind"].astype(str),
                        got_comm["stage"],
                        got_comm["microbatch"],
                        strict=True,
                    )
                )
                == comm
            )
            waits = ev[ev["kind"] == "WAIT"]
            recvs = {(s, m) for k, s, m in comm if k.startswith("RECV")}
            assert set(zip(waits["stage"], waits["microbatch"], strict=True)) <= recvs
            assert (ev["name"] == "STEP").sum() == 1


def test_overlap_parts_are_spans_of_their_own(profiled):
    """The runtime records each part of an overlap action as its own span inside the
    compound's, so each part row has its own interval: none is the compound's, none overlap."""
    _, res = profiled
    events = res.events[Config("dualpipev", 4, "vpipe").run_id(BENCH_ID)]
    compute = events[events["kind"].isin(["F", "B", "I", "W"])]
    assert compute["name"].astype(str).str.contains("OVERLAP").sum() == 0
    for _, g in compute.groupby(["rank", "step"], observed=True):
        g = g.sort_values("start_ns")
        assert (g["start_ns"].to_numpy()[1:] >= g["end_ns"].to_numpy()[:-1]).all()


def test_store_and_metrics(profiled, tmp_path):
    _, res = profiled
    write_outputs(res, tmp_path)
    runs = Store(tmp_path).runs()
    measured = runs[runs["source"] == "measured"]
    assert sorted(measured["schedule"]) == sorted(SCHEDULES)
    assert (measured["step_time_s"] > 0).all() and measured["bubble_ratio"].between(0, 1).all()
    assert (measured["peak_memory_bytes"] > 0).all()
    memory = Store(tmp_path).memory(list(measured["run_id"]))
    assert set(memory["what"]) == {"saved_activations"} and set(memory["rank"]) == {0, 1}


def test_analyze_predicts_from_a_bench_store(profiled, tmp_path):
    """`vpipe analyze` calibrates on one config of a bench store (several profiled steps) and
    predicts the others, judged against their own measured runs in the same store."""
    from vpipe.commands.trace import analyze_report

    _, res = profiled
    write_outputs(res, tmp_path)
    text = analyze_report(
        str(tmp_path), run=Config("1f1b", 4, "vpipe").run_id(BENCH_ID), predict=["zbv"]
    )
    assert "2 profiled steps" in text and "model in 4 pieces" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("zbv"))
    assert "nan" not in row.lower()  # the measured zbv run was found and compared
    # the calibration run's own schedule, asked for again, is its one row, not two
    text = analyze_report(
        str(tmp_path), run=Config("zbv", 4, "vpipe").run_id(BENCH_ID), predict=["zbv", "1f1b"]
    )
    rows = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("zbv", "1f1b"))]
    assert [r.split("  ")[0] for r in rows] == ["zbv (calibration run)", "1f1b"], text


def test_plan_from_a_measured_run(profiled, tmp_path):
    """`vpipe plan --from STORE --run RUN`: costs and activation bytes from a real run; its
    own config, re-predicted, matches what the store measured within reason."""
    from vpipe.predict.plan import Budget, from_run, plan

    _, res = profiled
    write_outputs(res, tmp_path)
    run_id = Config("zbv", 4, "vpipe").run_id(BENCH_ID)
    costs = from_run(str(tmp_path), run_id)
    assert costs.pieces == 4 and costs.rows == 2 and costs.bytes_per_piece_row > 0
    result = plan(costs, 2, 8, Budget(1e12))
    own = next(
        c for c in result["candidates"]
        if (c["schedule"], c["stages_per_rank"], c["microbatches"]) == ("zbv", 2, 4)
    )  # fmt: skip
    measured = Store(tmp_path).memory([run_id])
    peak = measured[measured["what"] == "saved_activations"].groupby("rank")["bytes"].max()
    assert max(own["peak_activation_bytes"]) == pytest.approx(peak.max(), rel=1e-6)
    assert result["recommended"]["fits"]


def test_analyze_fidelity_reads_a_bench_store(profiled, tmp_path, capsys):
    """`vpipe analyze STORE --fidelity` prints the bench report's leave-one-out table from
    the stored runs: one row and one column per profiled schedule."""
    from vpipe.cli import main

    _, res = profiled
    write_outputs(res, tmp_path)
    assert main(["analyze", str(tmp_path), "--fidelity"]) == 0
    out = capsys.readouterr().out
    assert f"{BENCH_ID} vpipe M=4: largest |error|" in out
    header = next(line for line in out.splitlines() if "calibrated on" in line and "1f1b" in line)
    assert header.split()[2:] == SCHEDULES
    assert sum(line.split()[0] in SCHEDULES for line in out.splitlines()) == len(SCHEDULES)
    # a bench output holds one sweep's timed steps: the table says how well they are known
    n = len(SCHEDULES) * (len(SCHEDULES) - 1)
    assert re.search(rf"(known to \+-[\d.]+% to \+-[\d.]+% .*; \d+ of {n} predictions|"
                     r"timed steps are too few to bound)", out), out
    assert main(["analyze", str(tmp_path / "nope"), "--fidelity"]) == 2
