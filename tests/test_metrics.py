"""The metric registry: a metric is one entry, and it then shows up in the runs table written
by ``collect``/``write_outputs``, the report's summary table, the ``vpipe analyze`` printout
and the asv suite's track_ methods. Sweep results here are synthetic (simulated timelines as
each rank's profiled events), so no process group is started."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from vpipe.commands.trace import analyze_report
from vpipe.metrics.catalogue import (
    Inputs,
    Metric,
    Show,
    Track,
    compute,
    register,
    registry,
    unregister,
)
from vpipe.metrics.per_run import quartiles, rank_metrics
from vpipe.report.document import summary_table
from vpipe.schedules import make_schedule
from vpipe.sim import CostModel, simulate
from vpipe.sweep.driver import SweepSpec
from vpipe.sweep.results import collect
from vpipe.sweep.write import write_outputs
from vpipe.trace.store import Store, run_columns

ROOT = Path(__file__).resolve().parents[1]


def _max_rank_busy(x: Inputs) -> float:
    busy = x.ranks.groupby(["run_id", "step"], observed=True)["busy_s"].max()
    return quartiles(busy)[1]


TOY = Metric(
    "max_rank_busy_s",
    "max busy ms",
    "s",
    "lower",
    "compute time of the busiest rank, median over steps",
    {"events": _max_rank_busy},
    show=Show(scale=1e3, unit="ms", digits=3, group="max rank busy"),
    asv=Track("max_rank_busy_s", "seconds"),
)


@pytest.fixture
def toy():
    register(TOY)
    try:
        yield TOY
    finally:
        unregister(TOY.name)


def _sweep_results(spec: SweepSpec) -> list[dict]:
    """What every rank of ``spec``'s sweep returns, with simulated timelines as events."""
    results = []
    for rank in range(spec.ranks):
        r = dict(rank=rank, host="h", threads=1, torch="t", sizes={}, tokens_per_sample=None,
                 cpu_allocator="cached")
        r.update(n_stages={}, times=[], rounds=[], memory={}, events={})
        results.append(r)
    for i, cfg in enumerate(spec.configs()):
        sched = make_schedule(cfg.schedule, spec.ranks, cfg.microbatches)
        ev = simulate(sched, CostModel(f=100.0, b=100.0, w=80.0, comm_latency=5.0)).to_events(
            "x", sched
        )
        for r in results:
            r["n_stages"][cfg.key] = sched.n_stages
            r["times"].append([0.01 * (1 + i + k / 10) for k in range(spec.rounds * spec.steps)])
            r["rounds"].append([k // spec.steps for k in range(spec.rounds * spec.steps)])
            r["memory"][cfg.key] = {"peak_bytes": 1000 * (r["rank"] + 1), "samples": [(0, 5)]}
            r["events"][cfg.key] = ev[ev["rank"] == r["rank"]].reset_index(drop=True)
    return results


def _load_suite():
    """benchmarks/benchmarks.py imported afresh, so its class is built from the registry now."""
    spec = importlib.util.spec_from_file_location(
        "vpipe_asv_suite", ROOT / "benchmarks" / "benchmarks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_registered_metric_reaches_runs_report_printout_and_asv(toy, tmp_path, monkeypatch):
    spec = SweepSpec(
        schedules=("interleaved-1f1b", "zbv"), microbatches=(4,), impls=("vpipe",),
        batch=8, steps=2, rounds=2,
    )  # fmt: skip
    results = _sweep_results(spec)
    res = collect(spec, results, "toy", 1.0)
    write_outputs(res, tmp_path / "out")

    runs = Store(tmp_path / "out").runs()
    assert "max_rank_busy_s" in run_columns() and "max_rank_busy_s" in runs.columns
    measured = runs[runs["source"] == "measured"].set_index("run_id")
    for cfg in spec.configs():
        ev = res.events[cfg.run_id("toy")]
        expected = rank_metrics(ev)["busy_s"].max()
        assert measured.loc[cfg.run_id("toy"), "max_rank_busy_s"] == pytest.approx(expected)
    assert runs.loc[runs["source"] == "simulated", "max_rank_busy_s"].isna().all()  # no events

    table = summary_table(res.measured)
    assert "max busy ms" in table.columns
    assert list(table.columns).index("max busy ms") == len(table.columns) - 1
    assert "max busy ms" in (tmp_path / "out" / "report.md").read_text()

    run_id = spec.configs()[0].run_id("toy")
    text = analyze_report(str(tmp_path / "out"), run=run_id, predict=[])
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("max rank busy"))
    assert f"{measured.loc[run_id, 'max_rank_busy_s'] * 1e3:.3f} ms" in line

    suite = _load_suite()
    assert "track_max_rank_busy_s" in suite.make_tracks()
    track = suite.PipelineCPU.track_max_rank_busy_s
    assert track.unit == "seconds"
    monkeypatch.chdir(tmp_path)  # asv runs a track in its round's cache directory
    assert track(None, {"zbv/4": {"max_rank_busy_s": 0.5}}, "zbv", 4) == {
        "samples": [0.5],
        "number": 1,
    }


def test_the_toy_metric_is_gone_once_unregistered():
    assert "max_rank_busy_s" not in run_columns()
    assert "max_rank_busy_s" not in _load_suite().make_tracks()


def test_asv_suite_keeps_its_tracks_and_units():
    tracks = {name: m.unit for name, m in _load_suite().make_tracks().items()}
    # only figures that hold across hosts: the step in reference units, and peak bytes
    assert tracks == {
        "track_normalised_step_in_ref_units": "host-speed reference units",
        "track_peak_bytes_per_rank": "bytes",
    }
    samples = next(m for m in registry() if m.name == "samples_per_s")
    assert samples.better == "higher" and samples.asv is None


def test_sources_in_order_and_derived_metrics():
    timed = [0.2, 0.1, 0.3, 0.4]
    row = compute(Inputs(steps=timed, batch=8, tokens_per_sample=16))
    assert row["step_time_s"] == pytest.approx(0.25)
    assert row["step_time_q1_s"] == pytest.approx(0.175)
    assert row["samples_per_s"] == pytest.approx(32) and row["tokens_per_s"] == pytest.approx(512)
    assert row["bubble_ratio"] is None and row["peak_memory_bytes"] is None  # no source
    assert row["normalised_step"] is None  # no reference timings
    assert row["profiled_step_time_s"] is None  # needs timed and profiled steps both
    assert compute(Inputs(steps=timed))["samples_per_s"] is None  # no batch


def test_registry_rejects_duplicates_and_bad_entries():
    with pytest.raises(ValueError, match="already registered"):
        register(registry()[0])
    with pytest.raises(ValueError, match="unknown source"):
        Metric("x", "x", "s", "lower", "", {"trace": lambda x: 1.0})
    with pytest.raises(ValueError, match="reciprocal"):
        Metric("y", "y", "1/s", "higher", "", {"row": lambda x: 1.0}, asv=Track("y", "1/s"))


def test_normalised_step_is_the_median_over_launches():
    """Per launch median step over median reference, then the median over launches (the
    geometric mean of two): a host twice as slow in the second launch (steps and reference
    alike) changes nothing, and one disturbed launch of three does not move it."""
    steps = [2.0, 2.2, 1.8, 4.0, 4.4, 3.6]
    refs = [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    row = compute(Inputs(steps=steps, refs=refs, blocks=[0, 0, 0, 1, 1, 1]))
    assert row["normalised_step"] == pytest.approx(2.0)
    faster_code = compute(Inputs(steps=[1.0, 1.1, 0.9], refs=[1.0, 1.0, 1.0]))
    assert faster_code["normalised_step"] == pytest.approx(1.0)
    mixed = compute(Inputs(steps=[2.0, 8.0], refs=[1.0, 2.0], blocks=[0, 1]))
    assert mixed["normalised_step"] == pytest.approx(math.sqrt(2.0 * 4.0))
    assert compute(Inputs(steps=[1.0, 2.0], refs=[1.0, 0.0]))["normalised_step"] is None
    one_bad = compute(Inputs(steps=[2.0, 2.0, 9.0], refs=[1.0, 1.0, 1.0], blocks=[0, 1, 2]))
    assert one_bad["normalised_step"] == pytest.approx(2.0)


def test_every_figure_means_the_same_in_analyze_runs_report_json_and_api(tmp_path, capsys):
    """One meaning per name: the timed median is step_time_s everywhere (analyze's text and
    JSON, vpipe runs, the runs table, the report's summary), the profiled steps' figures carry
    their own name, and the same value sits under the same name in each."""
    import json

    from vpipe.cli import main
    from vpipe.commands.trace import analysis_text, analyze

    spec = SweepSpec(schedules=("interleaved-1f1b", "zbv"), microbatches=(4,),
                     impls=("vpipe",), batch=8, steps=2, rounds=2)  # fmt: skip
    res = collect(spec, _sweep_results(spec), "toy", 1.0)
    write_outputs(res, tmp_path / "out")
    store, run_id = str(tmp_path / "out"), spec.configs()[1].run_id("toy")
    row = Store(store).run_meta(run_id)
    timed = [0.01 * (2 + k / 10) for k in range(4)]  # what _sweep_results gave zbv
    assert row["step_time_s"] == pytest.approx(quartiles(timed)[1])
    ev = res.events[run_id]
    profiled = quartiles(rank_metrics(ev).groupby("step")["window_s"].max())[1]
    assert row["profiled_step_time_s"] == pytest.approx(profiled)
    assert row["profiled_step_time_s"] != pytest.approx(row["step_time_s"])  # two figures

    assert main(["analyze", store, "--run", run_id, "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert main(["runs", store, "--json"]) == 0
    listed = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}[run_id]
    for name in ("step_time_s", "profiled_step_time_s"):
        assert metrics[name] == pytest.approx(row[name]) == pytest.approx(listed[name])
    assert metrics["samples_per_s"] == pytest.approx(spec.batch / row["step_time_s"])
    assert metrics["samples_per_s"] == pytest.approx(row["samples_per_s"])

    text = analysis_text(analyze(store, run=run_id, predict=[]))
    lines = {ln.split("  ")[1].strip(): ln for ln in text.splitlines() if ln.startswith("  ")}
    assert f"{row['step_time_s'] * 1e3:.3f} ms median" in lines["step time"]
    assert f"{row['profiled_step_time_s'] * 1e3:.3f} ms median" in lines["profiled step"]
    assert f"{row['samples_per_s']:.1f} samples/s" in lines["throughput"]
    assert "nan" not in text.lower()
    table = summary_table(res.measured).set_index("schedule")
    assert table.loc["zbv", "step ms (median)"] == f"{row['step_time_s'] * 1e3:.2f}"
    assert table.loc["zbv", "profiled step ms"] == f"{row['profiled_step_time_s'] * 1e3:.2f}"
    assert table.loc["zbv", "samples/s"] == f"{row['samples_per_s']:.1f}"

    # a trace alone has profiled steps only: no step_time_s, no throughput, never renamed
    trace_row = compute(Inputs(events=ev, batch=8))
    assert trace_row["step_time_s"] is None and trace_row["samples_per_s"] is None
    assert trace_row["profiled_step_time_s"] == pytest.approx(profiled)


@pytest.mark.parametrize("unit", ["rank", "stage"])
def test_peak_activations_carry_their_unit_in_text_json_and_api(unit, capsys):
    """simulate's text shows peak activations in the cost string's unit and names it; its JSON
    holds both units under names that say which; the API has the same lists."""
    import json

    from vpipe.cli import main

    cost = f"f=1,b=1,w=1,comm=0,unit={unit}"
    argv = ["simulate", "zbv", "-p", "4", "-m", "8", "--cost", cost]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    api = simulate(make_schedule("zbv", 4, 8), CostModel.parse(cost))
    assert data["peak_stage_activations"] == api.peak_stage_activations == [8, 8, 8, 8]
    assert data["peak_activation_units"] == api.peak_activation_units == [4.0, 4.0, 4.0, 4.0]
    assert "peak_activations" not in data
    assert main(argv) == 0
    text = capsys.readouterr().out
    shown = [float(ln.split()[3]) for ln in text.splitlines() if ln[:4].strip().isdigit()]
    name = "peak_stage_activations" if unit == "stage" else "peak_activation_units"
    assert shown == data[name]
    assert f"(JSON: {name})" in text
    with pytest.warns(DeprecationWarning, match="peak_stage_activations"):
        assert api.peak_activations == api.peak_stage_activations


def test_every_asv_figure_shows_its_unit():
    """asv prints a figure's unit only for seconds and bytes: any other unit is in the name."""
    import benchmarks.bench_sim as sim_suite

    classes = [_load_suite().PipelineCPU, sim_suite.ZBV64x1024]
    tracks = [getattr(c, n) for c in classes for n in dir(c) if n.startswith("track_")]
    assert len(tracks) == 2 + len(sim_suite.OPERATIONS)
    for t in tracks:
        assert t.unit in ("seconds", "bytes") or t.__name__.endswith("_in_ref_units"), t.__name__
