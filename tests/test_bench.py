"""``vpipe bench``: input validation, the saved-activation meter, and one quick real sweep
(two schedules x both implementations in one 2-rank launch) producing the runs table, events,
plots and report."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from report_reader import contradictions

from vpipe.cli import main
from vpipe.sweep.driver import SweepSpec
from vpipe.sweep.memory_meter import SavedTensorMeter


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schedules", "zbv,nope"], "unknown schedule 'nope'"),
        (["--impl", "vpipe,jax"], "unknown implementation 'jax'"),
        (["--batch", "10", "--microbatches", "4"], "batch 10 is not divisible into 4"),
        (["--microbatches", "4,x"], "--microbatches must be comma-separated integers"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--blocks", "0"], "--blocks must be >= 1"),
        (["--max-minutes", "-1"], "--max-minutes must be >= 0"),
        (["--timing-precision", "-1"], "--timing-precision must be >= 0"),
        (["--timing-precision", "100"], "--timing-precision is a percentage below 100, got 100"),
        (["--blocks", "2", "--max-minutes", "3"], "give --max-minutes 0 with --blocks"),
        (["--inject-delay-ms", "-1"], "--inject-delay-ms must be >= 0"),
        (["--inject-delay-pct", "-5"], "--inject-delay-pct must be >= 0"),
        (["--inject-delay-rank", "2"], "--inject-delay-rank 2 is not a rank of 2"),
        (["--model", "cnn"], "unknown model 'cnn'"),
        (["--sizes", "depth=3"], "model 'mlp' has no size 'depth'"),
    ],
)
def test_bad_sweep_is_rejected_before_launch(args, message, tmp_path, capsys):
    assert main(["bench", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not any(tmp_path.iterdir())  # nothing launched, nothing written


def test_sweep_configs_cover_the_grid():
    spec = SweepSpec(schedules=("zbv", "1f1b"), microbatches=(2, 4), impls=("vpipe", "torch"))
    keys = [c.key for c in spec.configs()]
    assert len(keys) == len(set(keys)) == 8
    assert "zbv-m2-torch" in keys and spec.backend == "gloo"
    assert SweepSpec(device="cuda").backend == "nccl"


def test_quick_has_the_pairs_an_interval_needs_and_rounds_to_settle_it():
    """--quick once timed 2 rounds of 2 steps: 4 pairs, under the 6 an interval needs, so its
    verdict was always "too few pairs"."""
    from vpipe.cli import build_parser
    from vpipe.commands.bench import sweep_spec
    from vpipe.stats import MIN_SAMPLES

    spec = sweep_spec(build_parser().parse_args(["bench", "--quick"]))
    assert spec.rounds * spec.steps >= MIN_SAMPLES and spec.max_minutes > 0
    fixed = sweep_spec(build_parser().parse_args(["bench", "--quick", "--max-minutes", "0"]))
    assert fixed.max_minutes == 0 and fixed.rounds * fixed.steps >= MIN_SAMPLES


def test_the_default_sweep_asks_its_medians_known_to_3_percent_and_quick_asks_nothing():
    from vpipe.cli import build_parser
    from vpipe.commands.bench import sweep_spec

    def spec(*args):
        return sweep_spec(build_parser().parse_args(["bench", *args]))

    assert spec().timing_precision == 3.0 and spec().max_minutes > 0
    assert spec("--quick").timing_precision == 0
    assert spec("--quick", "--timing-precision", "5").timing_precision == 5


def test_a_proportional_delay_sleeps_its_share_of_the_previous_step(monkeypatch):
    """--inject-delay-pct: the delaying rank sleeps that share of its own previous step (plus
    --inject-delay-ms), the other ranks do not; the step it measures excludes the sleep."""
    import threading
    from types import SimpleNamespace

    import vpipe.sweep.harness as harness

    slept: list[float] = []
    monkeypatch.setattr(harness.time, "sleep", slept.append)
    step_s = iter([0.03, 0.06, 0.01] * 2)

    def pipe_step(inputs, targets):  # a pipeline step of a known length, no sleep of its own
        threading.Event().wait(next(step_s))
        return []

    def rank(r: int) -> harness.RankHarness:
        h = harness.RankHarness.__new__(harness.RankHarness)
        h.spec = SimpleNamespace(inject_delay_s=0.002, inject_delay_share=0.5, inject_delay_rank=0)
        h.rank, h.params, h.inputs, h.targets = r, [], None, None
        h.pipe, h.last_step_s = SimpleNamespace(step=pipe_step), 0.0
        return h

    delaying = rank(0)
    lengths = []
    for _ in range(3):
        delaying.step()
        lengths.append(delaying.last_step_s)
    assert slept[0] == pytest.approx(0.002)  # no step before the first: the fixed part only
    assert slept[1:] == pytest.approx([0.002 + 0.5 * x for x in lengths[:2]])
    assert lengths[0] >= 0.03 and lengths[1] >= 0.06
    other = rank(1)
    for _ in range(3):
        other.step()
    assert len(slept) == 3


def test_saved_tensor_meter_counts_activations_until_backward():
    import torch

    lin = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    meter = SavedTensorMeter(exclude=lin.parameters())
    with meter.hooks():
        h = torch.relu(lin(x))
        y = torch.tanh(lin(h)).sum()
    # saved: x (for the weight gradient), relu's output (also lin's second input: one storage)
    # and tanh's output, 32x64 float32 each; the weight and its transposed view are excluded
    assert meter.peak == meter.live == 3 * 32 * 64 * 4
    y.backward()
    del y, h
    assert meter.live == 0
    assert lin.weight.grad is not None
    assert meter.samples[-1][1] == 0 and len(meter.samples) >= 6
    with_params = SavedTensorMeter()
    with with_params.hooks():
        torch.tanh(lin(x.requires_grad_())).sum()
    assert with_params.peak == 2 * 32 * 64 * 4 + 64 * 64 * 4  # x, tanh output, the weight


def test_saved_tensor_meter_releases_a_split_backward_after_w():
    """I keeps the graph for W; once W ran, every saved tensor is released, step after step
    (a meter holding the saved tensors themselves made a cycle that kept them forever)."""
    import torch

    from vpipe.models import build_model
    from vpipe.runtime.backward import backward_input, grad_node

    stage = build_model("gpt", 3, vocab=64, d_model=32, n_heads=2, n_layers=4, seq_len=16).stages[1]
    params = list(stage.parameters())
    nodes = {grad_node(p): p for p in params}
    meter = SavedTensorMeter(exclude=params)
    for _ in range(3):
        x = torch.randn(2, 16, 32, requires_grad=True)
        with meter.hooks():
            out = stage(x)
        _, task = backward_input([out], [torch.randn_like(out)], [x], nodes)
        del out
        task.run()
        del task
        assert meter.live == 0
    assert meter.peak > 0


def test_quick_sweep_writes_store_plots_and_report(tmp_path, capsys):
    out = tmp_path / "out"
    # --quick: interleaved-1f1b and zbv, M=4, both implementations (a tinier MLP and batch
    # here, the report's plan weighing M up to 8, not 16; its 3 rounds only: the minute of
    # rounds --quick adds to open configs is left out)
    rc = main(["bench", "--quick", "--sizes", "d_model=32,d_hidden=64", "--batch", "8",
               "--max-minutes", "0", "--out", str(out)])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "zbv" in printed and "report:" in printed
    # the verdict comes first, a line per implementation: the schedule to run, and why
    lines = printed.splitlines()
    assert lines[0].startswith("M=4 torch: run ") and lines[1].startswith("M=4 vpipe: run ")
    assert lines[-1].startswith("3 rounds; sweep ")  # --quick: 3 rounds, 6 pairs per config

    from vpipe.schedules import make_schedule
    from vpipe.trace.store import Store

    store = Store(out)
    runs = store.runs()
    measured = runs[runs["source"] == "measured"]
    assert sorted(zip(measured["schedule"], measured["impl"], strict=True)) == [
        ("interleaved-1f1b", "torch"),
        ("interleaved-1f1b", "vpipe"),
        ("zbv", "torch"),
        ("zbv", "vpipe"),
    ]
    assert (measured["step_time_s"] > 0).all() and (measured["peak_memory_bytes"] > 0).all()
    assert (measured["step_time_q1_s"] <= measured["step_time_q3_s"]).all()
    assert measured["bubble_ratio"].between(0, 1).all()
    simulated = runs[runs["source"] == "simulated"]
    assert len(simulated) == 4 and (simulated["step_time_s"] > 0).all()
    # the split probe: (I + W) / B on vpipe's stages, none for torch's runtime
    split = pd.to_numeric(measured["split_backward_ratio"], errors="coerce")
    assert (split[measured["impl"] == "vpipe"] > 0).all()
    assert split[measured["impl"] == "torch"].isna().all()
    # the forward probe: every stage's forward alone on vpipe's configs (4 stages each)
    from vpipe.predict.recompute_share import forward_alone_us

    for r in measured.itertuples():
        alone = forward_alone_us(r)
        assert (alone is None) == (r.impl == "torch"), r.impl
        if alone is not None:
            assert len(alone) == 4 and (alone > 0).all(), alone
    # the communication threads' CPU per step: measured where the 2 ranks' compute threads
    # take every core (they do by default: cores // ranks each), else left out
    from vpipe.trace.thread_cpu import cores_shared

    comm = pd.to_numeric(measured["comm_thread_cpu_s"], errors="coerce")
    shared = cores_shared(2 * int(measured["threads"].iloc[0]))
    assert (comm > 0).all() if shared else comm.isna().all(), comm
    # a prediction from the sweep charges them per message, and says so
    zbv = measured[(measured["schedule"] == "zbv") & (measured["impl"] == "vpipe")]
    capsys.readouterr()
    run_id = zbv["run_id"].iloc[0]
    rc = main(["analyze", str(out), "--run", run_id, "--predict", "interleaved-1f1b"])
    assert rc == 0
    assert ("us per message posted" in capsys.readouterr().out) == shared

    steps = pd.read_parquet(out / "steps.parquet")
    assert len(steps) == 4 * 3 * 2  # configs x rounds x steps (quick: 3 x 2)
    assert (steps["ref_s"] > 0).all() and set(steps["block"]) == {0}  # the host-speed reference
    host = pd.read_parquet(out / "host.parquet")
    assert list(host["round"]) == [0, 1, 2] and (host["other_cores"] >= 0).all()

    for row in measured.itertuples():
        ev = store.events([row.run_id])
        compute = ev[ev["kind"].isin(["F", "B", "I", "W"])]
        compute = compute[compute["step"] == compute["step"].max()]
        # one compute span per executed action on every rank in the profiled step
        sched = make_schedule(row.schedule, 2, 4)
        n = sum(len(a.compute_parts()) for _, _, a in sched.iter_actions() if a.is_compute)
        if row.impl == "vpipe":
            assert len(compute) == n
        assert set(ev["rank"]) == {0, 1}
        sim = store.events([f"{row.run_id}-sim"])
        assert len(sim[sim["kind"].isin(["F", "B", "I", "W"])]) == n
        mem = store.memory([row.run_id])
        assert set(mem["rank"]) == {0, 1} and mem["bytes"].max() > 0

    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert "throughput-per-schedule.png" in pngs and "peak-memory-per-schedule.png" in pngs
    assert any(p.startswith("gantt-zbv") for p in pngs)
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(pngs)
    assert not re.search(r"https?://", html)
    md = (out / "report.md").read_text()
    assert "V-schedules vs interleaved-1f1b" in md and "torch/vpipe" in md
    assert "## Simulator fidelity (vpipe, M=4)" in md and "calibrated on" in md
    # each fidelity section says how well its timed ratios are known (6 timed steps a config)
    said = re.findall(r"judged against are known to \+-[\d.]+% to \+-[\d.]+% \(95%, over the "
                      r"timed steps\); (\d) of 2 predictions lie outside them", md)
    assert len(said) == 2, md  # vpipe's and torch's
    assert "## Plan for this host" in md and "Recommended:" in md
    # two configs per implementation and M: one held out, too few to state the plan's error
    plan = md.split("## Plan for this host", 1)[1]
    assert "Predicted step times: error unknown: two configs measured, 1 held out" in plan
    assert "the default band, the error being unknown" in plan
    assert contradictions(md) == []  # the report read back: no statement another contradicts
