"""A real profiled 2-rank run (vpipe's runtime, gloo, spawned once for several schedules)
converts to exactly one compute row per executed action per profiled step, with the right
rank, stage, microbatch and kind; and the comm actions and waits show up too."""

import pytest

from vpipe.ir import parse_action
from vpipe.trace.profile_run import ProfileSpec, collect, profile_schedules, store_runs
from vpipe.trace.store import Store

SCHEDULES = ["1f1b", "zbv", "dualpipev"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof")
    spec = ProfileSpec(
        str(out), SCHEDULES, ranks=2, microbatches=4, batch=8, rounds=1,
        sizes={"d_model": 16, "d_hidden": 32, "n_blocks": 4},
    )  # fmt: skip
    programs = profile_schedules(spec, timeout_s=300)
    return spec, programs, collect(spec)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_compute_row_per_executed_action(profiled, schedule):
    spec, programs, tables = profiled
    events, memory, meta = tables[schedule]
    i = SCHEDULES.index(schedule)
    assert meta["schedule"] == schedule and set(events["rank"]) == {0, 1}
    steps = sorted(set(events["step"]))
    assert len(steps) == spec.rounds  # one profiled step per round
    for rank in (0, 1):
        program = [parse_action(a) for a in programs[rank][i]]
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
    assert set(memory["what"]) >= {"rss", "activations"}


def test_store_and_metrics(profiled):
    spec, _, tables = profiled
    root = store_runs(spec, tables)
    runs = Store(root).runs()
    assert sorted(runs["schedule"]) == sorted(SCHEDULES)
    assert (runs["step_time_s"] > 0).all() and runs["bubble_ratio"].between(0, 1).all()
    assert (runs["peak_memory_bytes"] > 0).all()
