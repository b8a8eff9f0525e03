"""``make gpu-check`` (bench/gpu_check.py): a clear one-line exit without CUDA, and both checks
passing when run on the CPU with a tiny model (the GPU run differs only in the device)."""

import pytest
import torch

from bench import gpu_check

TINY = {"vocab": 32, "d_model": 16, "n_heads": 2, "n_layers": 2, "seq_len": 8}


def test_without_cuda_one_line_and_status_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for check in ("check_v_one_rank", "check_two_ranks_one_gpu"):
        monkeypatch.setattr(gpu_check, check, lambda *a, **k: pytest.fail("a check ran"))
    assert gpu_check.main([]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device" in out


def test_v_placement_on_one_rank_passes_on_cpu():
    o = gpu_check.check_v_one_rank("cpu", TINY, batch=8, steps=3)
    assert o.ok, o.line()
    assert o.line().startswith("PASS v-one-rank: zbv P=1 stages [0, 1] on one rank")
    assert "fp32" in o.detail and "tol 1e-05" in o.detail
    assert "host clock" in o.detail and "CUDA allocator" not in o.detail


def test_two_ranks_sharing_a_device_pass_on_cpu(tmp_path, capsys):
    o = gpu_check.check_two_ranks_one_gpu(tmp_path, "cpu", TINY, batch=8)
    assert o.ok, o.line()
    # zbv at P=2, M=4: two stages per rank, each with F, I and W per microbatch
    assert "rank 0 24 (program 24), rank 1 24 (program 24)" in o.detail
    assert "0 USDT lines" in o.detail
    printed = capsys.readouterr().out
    assert "check: OK" in printed and "summary: zbv" in printed


def test_device_clock_checks_judge_synthetic_cuda_traces(tmp_path):
    """The device-timeline check passes a synthetic CUDA trace and fails the same trace read
    on launch spans; the agreement figures are relative differences."""
    from test_trace_kineto import META, PROGRAMS

    from bench.gpu_device_checks import agreement, timeline_findings
    from vpipe.trace.kineto import convert
    from vpipe.trace.synth import write_synthetic_run

    cuda = {**META, "device": "cuda"}
    dev = convert(write_synthetic_run(tmp_path / "d", PROGRAMS, meta=cuda, gpu=True))
    got = timeline_findings(dev.events)
    assert got["ok"] and got["worst"] < 1e-9
    with pytest.warns(UserWarning, match="launch times"):
        host = convert(write_synthetic_run(tmp_path / "h", PROGRAMS, meta=cuda))
    assert not timeline_findings(host.events)["ok"]  # rows on the host clock
    a = agreement({"0F0": 104, "0B0": 200, "x": 5, "0I0": 3}, {"0F0": 100, "0B0": 200, "0I0": 0})
    assert a["actions"] == 2 and a["total"] == pytest.approx(4 / 300)  # empty rows left out
    assert a["median"] == pytest.approx(0.02)
