"""``make gpu-check`` (bench/gpu_check.py): a clear one-line exit without CUDA, the checks
passing when run on the CPU with a tiny model (the GPU run differs only in the device), and
every check failing on an input built to break it."""

import numpy as np
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


@pytest.fixture(scope="module")
def synthetic_cuda(tmp_path_factory):
    """A converted synthetic CUDA run (two ranks) and its trace files."""
    from test_trace_kineto import META, PROGRAMS

    from vpipe.trace.kineto import convert
    from vpipe.trace.synth import write_synthetic_run

    paths = write_synthetic_run(
        tmp_path_factory.mktemp("cuda"), PROGRAMS, meta={**META, "device": "cuda"}, gpu=True
    )
    return convert(paths), paths


def test_v_one_rank_fails_on_a_mismatch(monkeypatch):
    """With a tolerance no float32 result meets, the reference comparison must fail."""
    from vpipe.sweep import harness

    monkeypatch.setattr(harness, "CHECK_TOL", {**harness.CHECK_TOL, "fp32": 0.0})
    o = gpu_check.check_v_one_rank("cpu", TINY, batch=8, steps=2)
    assert o.ok is False and "mismatches:" in o.detail, o.line()


def test_rows_against_the_program_fail_on_a_lost_row_or_a_host_row(synthetic_cuda):
    trace, _ = synthetic_cuda
    ev = trace.events
    want = {0: 6, 1: 6}  # 3 microbatches, F and B each
    assert gpu_check.rows_verdict(ev, want, "cuda")[0]
    lost = ev.drop(ev.index[(ev["name"].astype(str) == "1B2")][:1])
    assert not gpu_check.rows_verdict(lost, want, "cuda")[0]
    host = ev.assign(clock=ev["clock"].astype(str).replace("device", "host"))
    assert not gpu_check.rows_verdict(host, want, "cuda")[0]
    assert gpu_check.rows_verdict(host, want, "cpu")[0]  # on the CPU every row is the host's


def test_device_reference_is_a_measurement_and_nvml_figures_stand_alone():
    """The reference is reported, never counted as a pass; a deprecated NVML call loses its
    own figure only (clocks and temperature still read)."""
    from test_device_state import fake_nvml

    lib = fake_nvml(broken=("reasons",))
    o = gpu_check.probe_device_reference("cpu", size=32, repeats=3, nvml_lib=lib)
    assert o.measurement and o.ok is None and o.line().startswith("MEASURED device-reference:")
    f = o.figures
    assert f["sm_mhz"] == 1980 and f["temp_c"] == 41 and f["throttle"] is None
    passed = gpu_check.Outcome("x", True, "")
    failed = gpu_check.Outcome("y", False, "")
    assert gpu_check.summary([o, passed]) == (
        "1 of 1 checks passed; 1 measurement reported (not checks), 0 skipped"
    )
    assert gpu_check.summary([o, passed, failed]).startswith("1 of 2 checks passed")


def test_events_against_rows_fail_when_the_two_clocks_disagree():
    from bench.gpu_device_checks import agreement, events_verdict

    rows = {"0F0": 100_000, "0B0": 200_000, "0W0": 150_000}
    assert events_verdict({k: v * 1.01 for k, v in rows.items()}, rows)[0]
    ok, a = events_verdict({k: v * 1.2 for k, v in rows.items()}, rows)
    assert not ok and a["total"] == pytest.approx(0.2)
    assert not events_verdict({"other": 5}, rows)[0]  # no action in common
    a = agreement({"0F0": 104, "0B0": 200, "x": 5, "0I0": 3}, {"0F0": 100, "0B0": 200, "0I0": 0})
    assert a["actions"] == 2 and a["total"] == pytest.approx(4 / 300)  # empty rows left out
    assert a["median"] == pytest.approx(0.02)


def test_timeline_fails_on_host_rows_and_on_overlapping_rows(synthetic_cuda, tmp_path):
    from test_trace_kineto import META, PROGRAMS

    from bench.gpu_device_checks import timeline_findings
    from vpipe.trace.kineto import convert
    from vpipe.trace.synth import write_synthetic_run

    ev = synthetic_cuda[0].events
    assert timeline_findings(ev)["ok"]
    with pytest.warns(UserWarning, match="launch times"):
        host = convert(write_synthetic_run(tmp_path, PROGRAMS, meta={**META, "device": "cuda"}))
    assert "not on the device clock" in timeline_findings(host.events)["why"]
    f0 = ev.index[ev["name"].astype(str) == "0F0"][0]
    stretched = ev.copy()
    stretched.loc[f0, "end_ns"] += 10**9
    bad = timeline_findings(stretched)
    assert not bad["ok"] and ("overlap" in bad["why"] or "outside" in bad["why"])


def test_rows_against_the_kernels_union_fail_on_lost_or_invented_work(synthetic_cuda):
    """The rows' busy time matches the union of the raw trace's GPU ops (NCCL's own kernels
    aside: communication); an op the conversion lost, or busy time it invented, fails."""
    from bench.gpu_device_checks import kernel_union_findings, trace_ops_ns

    trace, paths = synthetic_cuda
    ev = trace.events[trace.events["rank"] == 0]
    s, e = trace_ops_ns(paths[0])
    got = kernel_union_findings(ev, s, e)
    assert got["ok"], got  # (gloo's own 1 us copy is no action's: 0.26%)
    compute = ev["kind"].astype(str).isin(["F", "B"])
    lost = ev.assign(busy_ns=ev["busy_ns"].where(~compute, ev["busy_ns"] // 2))
    assert not kernel_union_findings(lost, s, e)["ok"]
    invented = ev.assign(busy_ns=ev["busy_ns"].where(~compute, ev["busy_ns"] * 3 // 2))
    assert not kernel_union_findings(invented, s, e)["ok"]
    # an op no row holds: a second stream busy through the first step's first half
    w = ev[(ev["name"].astype(str) == "STEP")].sort_values("start_ns").iloc[0]
    mid = (int(w["start_ns"]) + int(w["end_ns"])) // 2
    assert not kernel_union_findings(ev, np.append(s, w["start_ns"]), np.append(e, mid))["ok"]


def test_host_bound_fails_when_the_rows_hold_the_sleep():
    import pandas as pd

    from bench.gpu_device_checks import SLEEP_S, host_bound_verdict

    ms = 1_000_000
    good = pd.DataFrame({"kind": ["F", "F"], "stage": [0, 0], "clock": ["device"] * 2,
                         "start_ns": [0, 50 * ms], "end_ns": [1 * ms, 51 * ms],
                         "launch_start_ns": [0, 40 * ms], "launch_end_ns": [25 * ms, 65 * ms]})  # fmt: skip
    assert host_bound_verdict(good)[0]
    slept = good.assign(end_ns=good["start_ns"] + int(SLEEP_S * 1e9))
    assert not host_bound_verdict(slept)[0]
    assert not host_bound_verdict(good.assign(clock="host"))[0]
    assert not host_bound_verdict(good.iloc[:0])[0]


def test_nccl_verdict_fails_on_host_waits_or_missing_rows(synthetic_cuda):
    from bench.gpu_device_checks import nccl_verdict

    ev = synthetic_cuda[0].events
    want = {0: 6, 1: 6}
    assert nccl_verdict(ev, "device", want)[0]
    assert not nccl_verdict(ev, "mixed", want)[0]
    wait = ev["kind"].astype(str) == "WAIT"
    host_waits = ev.assign(clock=ev["clock"].astype(str).where(~wait, "host"))
    assert not nccl_verdict(host_waits, "device", want)[0]
    assert not nccl_verdict(ev, "device", {0: 7, 1: 6})[0]


def test_quick_sweep_is_judged_out_of_sample_only():
    """The leave-one-out diagonal (a config from its own calibration) is never judged: a
    perfect diagonal with one bad cross prediction fails, a bad diagonal alone does not."""
    import pandas as pd

    from bench.gpu_sweeps import cross_config_errors, cross_config_verdict

    table = pd.DataFrame({"calibrated on": ["1f1b", "zbv"], "1f1b": [0.0, 0.04],
                          "zbv": [0.25, 0.0]})  # fmt: skip
    cross = cross_config_errors([table])
    assert sorted(cross) == [("1f1b", "zbv", 0.25), ("zbv", "1f1b", 0.04)]
    ok, words = cross_config_verdict(cross)
    assert not ok and "+25.0% (zbv from 1f1b's calibration" in words
    in_sample_only_bad = table.assign(**{"1f1b": [0.5, 0.04], "zbv": [0.05, 0.5]})
    assert cross_config_verdict(cross_config_errors([in_sample_only_bad]))[0]
    assert not cross_config_verdict([])[0]  # one config: nothing predicted out of sample
    assert not cross_config_verdict([("a", "b", float("nan"))])[0]


def test_a_a_passes_only_within_noise():
    from bench.gpu_sweeps import a_a_verdict, markdown_verdicts

    md = ("## Host\n\n| run | load |\n|---|---|\n| a | 0.1 |\n\n## Speedup over a\n\n"
          "| schedule | M | verdict | to settle |\n|---|---|---|---|\n"
          "| zbv | 4 | within noise |  |\n| 1f1b | 4 | {} | more rounds |\n")  # fmt: skip
    assert markdown_verdicts(md.format("within noise")) == ["within noise"] * 2
    assert a_a_verdict(markdown_verdicts(md.format("within noise")))[0]
    for word in ("inconclusive", "device differed", "too few steps (< 3)", "faster", "slower"):
        ok, words = a_a_verdict(markdown_verdicts(md.format(word)))
        assert not ok and f"1 {word}" in words
    assert not a_a_verdict([])[0]


def test_gloo_sweep_fails_without_its_regime_or_its_left_out_line():
    from bench.gpu_sweeps import gloo_verdict

    printed = "torch baseline left out: gloo cannot carry CUDA tensors\n"
    md = "# report\nOverhead-bound: posting dominates\n"
    assert gloo_verdict(printed, md)[0]
    assert not gloo_verdict(printed, "# report\n")[0]
    assert not gloo_verdict("", md)[0]
