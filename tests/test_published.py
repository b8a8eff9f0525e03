"""`python -m bench.published` on a small table of the paper's shape: the measured figures are
compared with, never used (changing them changes no prediction); and the share of saved
activations an input gradient frees, measured by the runtime against the model's count."""

from __future__ import annotations

import json

import pytest
import torch

from bench import published
from vpipe.models import build_model
from vpipe.runtime.saved_share import saved_around_i
from vpipe.sim.arch import Arch


def entry(table, model, metric, value, kind, setup=None, schedule=None, m=None):
    return {"table": table, "model": model, "setup": setup, "schedule": schedule, "m": m,
            "metric": metric, "value": value, "unit": "", "kind": kind}  # fmt: skip


def tables(scale: float = 1.0) -> dict:
    """One 6-layer model profiled on 4 GPUs; Table 12 and 6 rows for every schedule."""
    entries = [entry("Table 3 (models)", "1B", k, v, "setup") for k, v in
               (("layers", 6), ("attention_heads", 8), ("hidden_size", 1024), ("seq_len", 128))]
    setup = {"gpus": 4, "pp_stages": 4, "microbatch_size": 2}
    for metric, value in (("T_F", 1.0), ("T_B", 1.0), ("T_W", 0.6), ("T_comm", 0.05)):
        entries.append(entry("Table 9 (profiled)", "1B", metric, value, "profiled", setup,
                             "ZB-2p (profiling run)", 8))  # fmt: skip
    for sched, m, value in (("1F1B", 4, 10.0), ("ZB-2p", 4, 12.0)):
        entries.append(entry("Table 12 (m <= p)", "1B", "throughput", value * scale, "measured",
                             setup, sched, m))  # fmt: skip
    for sched, mb, m, value in (("1F1B", 2, 8, 20.0), ("ZB-1p", 2, 8, 22.0),
                                ("ZB-2p*", 1, 16, 23.0), ("ZB-V", 2, 8, 24.0)):
        s = {**setup, "microbatch_size": mb, "global_batch_samples": 16}
        entries.append(entry("Table 6 (ZB-V)", "1B", "throughput", value * scale, "measured",
                             s, sched, m))  # fmt: skip
    return {"entries": entries}


def run(tmp_path, scale: float) -> list[dict]:
    path = tmp_path / f"t{scale}.json"
    path.write_text(json.dumps(tables(scale)))
    return published.predictions(published.load(path))


def test_measured_figures_change_no_prediction(tmp_path):
    a, b = run(tmp_path, 1.0), run(tmp_path, 1.7)
    assert [r["predicted"] for r in a] == [r["predicted"] for r in b]
    assert [r.get("speedup_predicted") for r in a] == [r.get("speedup_predicted") for r in b]
    assert [r["measured"] * 1.7 for r in a] == pytest.approx([r["measured"] for r in b])
    speedups = {(r["table"], r["schedule"]): r for r in a if "error" in r}
    assert set(speedups) == {("Table 12", "ZB-2p"), ("Table 6", "ZB-1p"), ("Table 6", "ZB-2p*"),
                             ("Table 6", "ZB-V")}  # fmt: skip
    for r in speedups.values():
        assert r["error"] == pytest.approx(r["speedup_predicted"] / r["speedup_measured"] - 1)
        assert r["speedup_predicted"] > 1  # zero-bubble schedules beat 1F1B here


def test_profiled_times_come_back_from_the_rates(tmp_path):
    data = published.load(_write(tmp_path))
    rates, bandwidth = published.profiled_costs(data, "1B")
    arch = published.arch_of("1B", data["models"]["1B"], 2)
    # the profiled stage is a middle one: 2 layers of the 6 on 4 stages ([1, 2, 2, 1])
    assert 2 * arch.layer_flops("F") / rates.f == pytest.approx(1e-3)
    assert 2 * arch.layer_flops("W") / rates.w == pytest.approx(0.6e-3)
    assert bandwidth == pytest.approx(arch.boundary_bytes() / 0.05e-3)


def _write(tmp_path):
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(tables()))
    return path


def test_the_runtime_measures_what_f_saves_and_i_keeps():
    sizes = dict(vocab=512, d_model=128, n_heads=4, n_layers=4, seq_len=64)
    stage = build_model("gpt", 3, **sizes).stages[1]  # two decoder blocks
    x, g = torch.randn(4, 64, 128), torch.randn(4, 64, 128)
    got = saved_around_i(stage, (x,), (g,))
    arch = Arch("gpt", layers=4, hidden=128, heads=4, seq_len=64, vocab=512, microbatch=4,
                precision="fp32")  # fmt: skip
    # the model's count, less the stage's input (the previous stage's output, not counted)
    predicted = 2 * arch.layer_saved_bytes() - x.numel() * 4
    assert got.after_f == pytest.approx(predicted, rel=0.02)
    # vpipe's runtime keeps the graph from I to W and adds the output gradients it recorded
    assert got.after_i > got.after_f and got.i_frees == 0.0
    assert got.after_w == 0
