"""``vpipe bench --dp N``: bad data-parallel sweeps refused in one line before any launch; the
measured DP figures from hand-made reductions; one quick P=2 x DP=2 sweep (4 gloo processes)
whose report holds the DP share per schedule, measured and simulated."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from vpipe.cli import main
from vpipe.sweep.dp_bench import busy_seconds, measured_dp, steps_frame


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--impl", "torch"], "--dp runs vpipe's runtime only: leave torch out of --impl"),
        (["--impl", "vpipe,torch"], "--dp runs vpipe's runtime only"),
        (["--batch", "12", "-m", "4"], "batch 12 does not shard into 2 replicas x 4 microbatches"),
        (["--backend", "nccl"], "the dp group cannot reduce cpu gradients on nccl"),
        (["--fsdp"], "gloo has no reduce_scatter_tensor"),
        (["--dp-bucket-mb", "0"], "--dp-bucket-mb must be > 0"),
    ],
)
def test_bad_dp_sweep_is_refused_before_launch(args, message, tmp_path, capsys):
    assert main(["bench", "--quick", "--dp", "2", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not any(tmp_path.iterdir())


def test_a_torchrun_world_that_is_not_ranks_x_replicas_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setattr("vpipe.runtime.launch.in_torchrun", lambda: True)
    assert main(["bench", "--quick", "--dp", "2", "-p", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "world size 6 is not pipeline ranks x replicas = 2 x 2 = 4" in err
    assert not any(tmp_path.iterdir())


def _record(step: int, rank: int, wait_ms: float, pipe_ms: float, spans: list) -> dict:
    return {
        "config": 0,
        "step": step,
        "rank": rank,
        "replica": rank // 2,
        "pp_rank": rank % 2,
        "wait_s": wait_ms / 1e3,
        "pipe_step_s": pipe_ms / 1e3,
        "reductions": [
            {"stage": s, "bucket": b, "bytes": 100, "start_ns": t0 * 10**6, "end_ns": t1 * 10**6}
            for s, b, t0, t1 in spans
        ],
    }


def test_measured_share_comes_from_the_rank_that_finished_last():
    # overlapping spans count once: [0, 4] and [2, 5] ms cover 5 ms; [7, 8] one more
    assert busy_seconds([{"start_ns": a * 10**6, "end_ns": b * 10**6} for a, b in
                         [(2, 5), (0, 4), (7, 8)]]) == pytest.approx(6e-3)  # fmt: skip
    records = [
        # step 0: rank 1 finishes last (its step 20 ms), waited 3 of its 6 ms of reducing
        _record(0, 0, 1.0, 18.0, [(0, 0, 10, 12)]),
        _record(0, 1, 3.0, 20.0, [(1, 0, 12, 15), (1, 1, 15, 18)]),
        # step 1: rank 0 finishes last, waited 0 of 4 ms
        _record(1, 0, 0.0, 22.0, [(0, 0, 10, 14)]),
        _record(1, 1, 5.0, 21.0, [(1, 0, 12, 20)]),
        # replica 1: the same stages, fast: never the slowest
        _record(0, 2, 0.0, 10.0, [(0, 0, 1, 2)]),
        _record(0, 3, 0.0, 10.0, [(1, 0, 1, 2), (1, 1, 2, 3)]),
    ]
    frame = steps_frame(records)
    assert list(frame["stages"]) == ["0", "1", "0", "1", "0", "1"]
    got = measured_dp(frame, times=[0.025, 0.030], per_block=2)
    # medians over the two steps of (reducing, exposed, hidden, exposed / timed step)
    assert got["dp_reduce_s"] == pytest.approx((6e-3 + 4e-3) / 2)
    assert got["dp_exposed_s"] == pytest.approx(1.5e-3)
    assert got["dp_hidden_s"] == pytest.approx((3e-3 + 4e-3) / 2)
    assert got["dp_share"] == pytest.approx((3 / 25 + 0) / 2)
    assert got["dp_bytes"] == 300 and got["dp_buckets"] == 3  # replica 0, one step


def test_quick_p2_dp2_sweep_reports_the_dp_share_per_schedule(tmp_path, capsys):
    from vpipe.models import build_model
    from vpipe.trace.store import Store

    out = tmp_path / "out"
    sizes = {"d_model": 32, "d_hidden": 64}
    rc = main(["bench", "--dp", "2", "-p", "2", "--quick", "--schedules", "1f1b,zbv", "--sizes",
               ",".join(f"{k}={v}" for k, v in sizes.items()), "--max-minutes", "0",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "DP share" in printed and "report:" in printed

    runs = Store(out).runs()
    measured = runs[runs["source"] == "measured"]
    assert set(measured["impl"]) == {"vpipe"} and set(measured["dp"]) == {2}
    assert sorted(measured["schedule"]) == ["1f1b", "zbv"]
    # every replica's gradients are the whole model's, in float32
    resolved = json.loads(measured["sizes"].iloc[0])  # grown to the largest stage count
    n_bytes = 4 * build_model("mlp", int(measured["stages"].max()), 0, **resolved).n_params
    assert (measured["dp_bytes"] == n_bytes).all()
    for col in ("dp_reduce_s", "dp_exposed_s", "dp_hidden_s"):
        assert (measured[col] >= 0).all(), col
    assert (measured["dp_reduce_s"] > 0).all()
    assert (measured["dp_exposed_s"] < measured["step_time_s"]).all()
    simulated = runs[runs["source"] == "simulated"]
    assert len(simulated) == 2 and simulated["dp_share"].between(0, 1).all()
    # the simulated step is the pipeline's plus its exposed reductions
    assert (
        (simulated["pipeline_step_s"] + simulated["dp_exposed_s"] - simulated["step_time_s"]).abs()
        < 1e-9
    ).all()

    steps = pd.read_parquet(out / "dp_steps.parquet")
    assert set(steps["rank"]) == {0, 1, 2, 3} and set(steps["replica"]) == {0, 1}
    assert len(steps) == 2 * 4 * 3 * 2  # configs x ranks x rounds x steps (quick: 3 x 2)
    for row in measured.itertuples():  # events and memory of replica 0's pipeline ranks
        ev = Store(out).events([row.run_id])
        assert set(ev["rank"]) == {0, 1}
        assert (ev["kind"].astype(str) == "REDUCE").any()
    ranks = pd.read_parquet(out / "ranks.parquet")
    assert set(ranks["rank"]) == {0, 1}

    report = (out / "report.md").read_text()
    section = report.split("## Data parallel: DP share per schedule", 1)[1].split("\n## ", 1)[0]
    table = [ln for ln in section.splitlines() if ln.startswith("| ") and "schedule" not in ln]
    assert sorted(ln.split(" | ")[0].strip("| ") for ln in table) == ["1f1b", "zbv"]
    assert all(ln.count("%") == 2 for ln in table)  # measured and simulated DP share
    plan = report.split("## Plan for this host", 1)[1]
    assert "Each candidate's step ends with its reductions across 2 replicas" in plan
