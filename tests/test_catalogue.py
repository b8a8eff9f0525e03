"""The schedule catalogue: every list of schedule names derives from it, a registered family
shows up everywhere (listing, compare, sweep validation, plots, report), a family torch has no
class for runs on vpipe only, and every catalogue row agrees with its generator and torch."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from vpipe.baselines.torch_pp import TORCH_SCHEDULES, torch_placement
from vpipe.cli import main
from vpipe.errors import ScheduleError
from vpipe.ir import Schedule, loop_placement
from vpipe.ir.lowering import lower, validate
from vpipe.report.document import BASELINE, v_vs_baseline, vpipe_only_note
from vpipe.schedules import GENERATORS, catalogue, make_schedule, schedule_names
from vpipe.schedules._common import B, F, build, check_counts, resolve_stages_per_rank
from vpipe.schedules.load import load_schedule
from vpipe.schedules.v import zbv
from vpipe.sweep.driver import DEFAULT_SCHEDULES, QUICK_SCHEDULES, BenchError, SweepSpec
from vpipe.sweep.results import BenchResults
from vpipe.sweep.write import report_sections

TOY = "toy-naive"
TOY_V = "toy-v"


def toy_naive(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """No pipelining at all: each rank runs one microbatch's forward and backward before the
    next microbatch's (1 stage per rank, loop placement)."""
    p, m = check_counts(TOY, ranks, microbatches)
    resolve_stages_per_rank(TOY, stages_per_rank, default=1, fixed="one stage per rank")
    actions = [[a for mb in range(m) for a in (F(r, mb), B(r, mb))] for r in range(p)]
    return build(TOY, p, m, loop_placement(p, p), actions, stages_per_rank=1)


def toy_v(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """ZB-V under another name: a V-placement family torch has no class for."""
    s = zbv(ranks, microbatches, stages_per_rank)
    s.name = TOY_V
    return s


@pytest.fixture
def toy():
    """The toy family, listed between gpipe and 1f1b, while the test runs."""
    family = catalogue.register(
        catalogue.Family(
            TOY,
            toy_naive,
            "toy: one microbatch at a time, no pipelining; 1 stage/rank",
            placement="loop",
            stages_per_rank=1,
            order=15,
        )
    )
    try:
        yield family
    finally:
        catalogue.unregister(TOY)


@pytest.fixture
def toy_v_family():
    catalogue.register(
        catalogue.Family(TOY_V, toy_v, "toy: zbv renamed", placement="v", stages_per_rank=2)
    )
    try:
        yield
    finally:
        catalogue.unregister(TOY_V)


# ---------------------------------------------------------------------------------------------
# The built-in catalogue


def test_builtin_lists_derive_from_the_catalogue():
    assert catalogue.names() == (
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
        "zb-h1",
        "zb-h2",
        "zbv",
        "v-half",
        "v-min",
        "dualpipev",
        "auto",
    )
    assert list(GENERATORS) == list(schedule_names()) == list(catalogue.names())
    assert DEFAULT_SCHEDULES == ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
    assert QUICK_SCHEDULES == ("interleaved-1f1b", "zbv")
    assert BASELINE == catalogue.baseline() == "interleaved-1f1b"
    with_torch = catalogue.names(lambda f: f.torch_class is not None)
    assert list(TORCH_SCHEDULES) == list(with_torch)
    assert set(catalogue.names()) - set(with_torch) == {"zb-h2", "v-half", "v-min", "auto"}


@pytest.mark.parametrize("family", catalogue.families(), ids=lambda f: f.name)
def test_row_matches_its_generator_and_torch_class(family):
    import torch.distributed.pipelining as pp

    for p, m in ((2, 4), (3, 6)):
        s = make_schedule(family.name, p, m)
        assert s.name == family.name
        assert s.style == family.placement
        assert s.stages_per_rank == family.stages_per_rank
        if family.torch_class is not None:
            assert hasattr(pp, family.torch_class)
            assert torch_placement(family.name, p, s.n_stages) == s.placement
            assert TORCH_SCHEDULES[family.name].multi == family.torch_multi


# ---------------------------------------------------------------------------------------------
# Registering a family


def test_toy_family_generates_a_valid_schedule(toy):
    s = make_schedule(TOY, 3, 4)
    validate(lower(s))
    assert s.name == TOY and GENERATORS[TOY] == (toy_naive, toy.description)
    assert load_schedule(TOY, 3, 4).to_rows() == s.to_rows()
    assert TOY not in TORCH_SCHEDULES
    with pytest.raises(
        ScheduleError, match=f"no torch.distributed.pipelining schedule for '{TOY}'"
    ):
        torch_placement(TOY, 3, 3)


def test_toy_family_is_listed_by_vpipe_schedules(toy, capsys):
    assert main(["schedules"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["gpipe", TOY, "1f1b"]
    assert lines[1].rstrip().endswith(toy.description)


def test_toy_family_is_compared_by_vpipe_compare(toy, capsys):
    assert main(["compare", "--ranks", "2", "--microbatches", "4", "--json"]) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["schedules"]}
    assert list(rows) == list(catalogue.names())
    # Nothing overlaps: per microbatch, F (1) then B (b + w = 2) on each of the P ranks in turn.
    assert rows[TOY]["makespan"] == pytest.approx(4 * 2 * 3)


def test_sweep_runs_a_family_without_torch_class_on_vpipe_only(toy):
    spec = SweepSpec(schedules=("zbv", TOY), microbatches=(2, 4), impls=("vpipe", "torch"))
    spec.validate()  # no torch placement check for the toy family
    assert [c.key for c in spec.configs()] == [
        "zbv-m2-vpipe",
        "zbv-m2-torch",
        "zbv-m4-vpipe",
        "zbv-m4-torch",
        f"{TOY}-m2-vpipe",
        f"{TOY}-m4-vpipe",
    ]
    only_torch = replace(spec, impls=("torch",))
    assert [c.key for c in only_torch.configs()] == ["zbv-m2-torch", "zbv-m4-torch"]
    with pytest.raises(BenchError, match=f"torch.distributed.pipelining has no class for {TOY};"):
        replace(spec, schedules=(TOY,), impls=("torch",)).validate()


def test_builtins_without_torch_class_sweep_on_vpipe_only():
    names = ("v-half", "v-min", "zb-h2", "auto")
    spec = SweepSpec(schedules=names, microbatches=(4,), impls=("vpipe", "torch"))
    spec.validate()
    assert [c.key for c in spec.configs()] == [f"{n}-m4-vpipe" for n in names]


def test_unknown_sweep_schedule_lists_registered_families(toy):
    with pytest.raises(BenchError, match=f"choose from gpipe, {TOY}, 1f1b"):
        SweepSpec(schedules=("nope",), impls=("vpipe",)).validate()


def test_plots_order_registered_families_by_their_display_order(toy):
    assert catalogue.display_order(["custom", "1f1b", TOY, "gpipe"]) == ["gpipe", TOY, "1f1b", "custom"]


def test_report_v_schedules_include_registered_v_families(toy_v_family):
    runs = pd.DataFrame(
        [
            dict(impl="vpipe", microbatches=4, schedule=s, samples_per_s=x, peak_memory_bytes=y)
            for s, x, y in (("interleaved-1f1b", 100, 2**20), (TOY_V, 120, 2**21))
        ]
    )
    steps = pd.DataFrame(
        [
            dict(schedule=s, microbatches=4, impl="vpipe", round=0, step=k, step_time_s=8 / x)
            for s, x in (("interleaved-1f1b", 100), (TOY_V, 120))
            for k in range(6)
        ]
    )
    vv = v_vs_baseline(runs, steps)
    assert list(vv["schedule"]) == [TOY_V]
    assert vv.iloc[0]["throughput ratio"] == "1.20" and vv.iloc[0]["peak memory ratio"] == "2.00"


def _results(spec: SweepSpec) -> BenchResults:
    """Synthetic tables for every config of ``spec`` (no launch)."""
    runs, steps, ranks = [], [], []
    for i, cfg in enumerate(spec.configs()):
        t = 0.01 * (1 + i)
        key = dict(schedule=cfg.schedule, microbatches=cfg.microbatches, impl=cfg.impl)
        runs.append(
            dict(
                key,
                run_id=cfg.run_id("b"),
                source="measured",
                step_time_s=t,
                step_time_q1_s=t,
                step_time_q3_s=t,
                samples_per_s=spec.batch / t,
                peak_memory_bytes=2**20,
            )
        )
        steps += [
            dict(key, round=0, step=k, step_time_s=t, samples_per_s=spec.batch / t)
            for k in range(2)
        ]
        ranks += [dict(key, rank=r, peak_bytes=2**20) for r in range(spec.ranks)]
    meta = {"bench_id": "b"}
    return BenchResults(
        spec, "b", meta, pd.DataFrame(runs), pd.DataFrame(steps), pd.DataFrame(ranks)
    )


def test_report_says_a_family_runs_on_vpipe_only(toy):
    spec = SweepSpec(schedules=("interleaved-1f1b", TOY), microbatches=(4,))
    sections = {s.title: s for s in report_sections(_results(spec))}
    summary = sections["Summary"]
    note = f"{TOY}: torch.distributed.pipelining has no class for it; vpipe only."
    assert note in summary.markdown and note in summary.html
    table = summary.markdown.split("\n\n", 1)[1]
    assert f"| 4 | vpipe | {TOY} |" in table and f"| 4 | torch | {TOY} |" not in table
    assert vpipe_only_note([TOY, "zbv"], ["vpipe"]) == ""  # torch not asked for: nothing to say
    assert vpipe_only_note(["zbv"], ["vpipe", "torch"]) == ""


# ---------------------------------------------------------------------------------------------
# Bad registrations


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(name="a,b"), "without commas or whitespace"),
        (dict(name=""), "must be a non-empty string"),
        (dict(placement="ring"), "placement must be one of loop, v, got 'ring'"),
        (dict(stages_per_rank=0), "stages_per_rank must be a positive integer, got 0"),
        (dict(torch_multi=True), "torch_multi needs a torch_class"),
    ],
)
def test_bad_family_is_refused(change, message):
    fields = dict(
        name="bad", generator=toy_naive, description="d", placement="loop", stages_per_rank=1
    )
    with pytest.raises(ScheduleError, match=message):
        catalogue.Family(**{**fields, **change})


def test_register_refuses_duplicates_and_a_second_baseline(toy):
    with pytest.raises(ScheduleError, match=f"'{TOY}' is already registered"):
        catalogue.register(toy)
    with pytest.raises(ScheduleError, match=r"already has a baseline \(interleaved-1f1b\)"):
        catalogue.register(replace(toy, name="other", baseline=True))
    assert "other" not in catalogue.names()


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ScheduleError, match="unknown schedule 'nope': choose one of gpipe, 1f1b"):
        catalogue.unregister("nope")


def test_real_sweep_runs_a_registered_family(toy, tmp_path):
    """Ranks receive schedules built in the launching process, so a family registered only
    here runs in a real 2-rank sweep, end to end into the store and the report."""
    from vpipe.sweep.driver import run_sweep
    from vpipe.sweep.results import collect
    from vpipe.sweep.write import write_outputs
    from vpipe.trace.store import Store

    spec = SweepSpec(
        schedules=("zbv", TOY), microbatches=(2,), impls=("vpipe", "torch"), batch=4,
        sizes={"d_model": 16, "d_hidden": 32}, warmup=1, steps=1, rounds=1, progress=False,
    )  # fmt: skip
    spec.validate()
    write_outputs(collect(spec, run_sweep(spec, "toy"), "toy", 0.0), tmp_path)
    runs = Store(tmp_path).runs()
    toy_runs = runs[(runs["schedule"] == TOY) & (runs["source"] == "measured")]
    assert list(toy_runs["impl"]) == ["vpipe"] and (toy_runs["step_time_s"] > 0).all()
    assert len(Store(tmp_path).events(list(toy_runs["run_id"]))) > 0
    assert TOY in (tmp_path / "report.md").read_text()
