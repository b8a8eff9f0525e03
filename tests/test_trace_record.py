"""StepProfiler writes one Kineto JSON per rank with the run metadata and memory samples."""

import json

import pytest

from vpipe.trace.record import StepProfiler


def _fake_steps(prof: StepProfiler, n: int) -> None:
    import torch
    from torch.profiler import record_function

    for k in range(n):
        with record_function(f"PP:STEP:{k}"):
            with record_function("PP:0F0"):
                x = torch.randn(32, 32, requires_grad=True)
                y = (x @ x).sum()
            with record_function("PP:0B0"):
                y.backward()
        prof.step(memory={"activations": 100 + k})


def test_writes_trace_with_metadata_and_samples(tmp_path):
    meta = {"run_id": "r1", "schedule": "1f1b", "impl": "vpipe", "ranks": 2}
    with StepProfiler(tmp_path, 1, wait=1, warmup=1, active=2, metadata=meta) as prof:
        _fake_steps(prof, 6)
    assert prof.written
    trace = json.loads((tmp_path / "rank1.pt.trace.json").read_text())
    assert trace["vpipe"]["run_id"] == "r1" and trace["vpipe"]["rank"] == 1
    steps = sorted({s["step"] for s in trace["vpipe_samples"]})
    assert steps == [2, 3]  # only the active window is sampled
    acts = [s["bytes"] for s in trace["vpipe_samples"] if s["what"] == "activations"]
    assert acts == [102, 103]
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"PP:STEP:2", "PP:STEP:3", "PP:0F0", "PP:0B0"} <= names
    assert "PP:STEP:1" not in names  # warmup is discarded
    assert not list(tmp_path.glob(".*"))  # no temp file left behind


def test_none_is_noop_and_short_run_warns(tmp_path):
    with StepProfiler(None, 0) as prof:
        prof.step()
    assert not prof.enabled and not prof.written
    with pytest.warns(UserWarning, match="no profiler trace written"):
        with StepProfiler(tmp_path, 0, wait=1, warmup=1, active=1) as prof:
            prof.step()
    assert not list(tmp_path.iterdir())


def test_trace_is_named_for_tensorboard_and_old_names_still_convert(tmp_path):
    """``rank{N}.pt.trace.json`` (TensorBoard's profiler plugin lists ``*.pt.trace.json``);
    the converter reads the rank from that name, and from the old ``rank{N}.json``."""
    from vpipe.trace.kineto import convert

    with StepProfiler(tmp_path / "new", 2, wait=0, warmup=1, active=1) as prof:
        _fake_steps(prof, 2)
    path = tmp_path / "new" / "rank2.pt.trace.json"
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    doc = json.loads(path.read_text())
    doc.pop("vpipe")  # no rank in the metadata: the file name tells it
    doc.pop("distributedInfo", None)
    path.write_text(json.dumps(doc))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "rank2.json").write_text(json.dumps(doc))
    for run in ("new", "old"):
        ev = convert([tmp_path / run]).events
        assert set(ev["rank"]) == {2} and set(ev["name"]) >= {"0F0", "0B0"}


CHATTER = b"USDT:2026-01-01 12:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"


def test_filtered_stderr_drops_kineto_chatter_and_keeps_the_rest(capfd):
    import os

    from vpipe.trace.quiet import filtered_stderr

    with filtered_stderr():
        os.write(2, CHATTER + b"a real error\n")
        os.write(2, b"STAGE:2024-01-01 12:00:00 1:1 ActivityProfilerController.cpp:3] Done\n")
        os.write(2, b"USDT: not kineto's format, kept\nno newline at the end")
    os.write(2, b"|after")
    assert capfd.readouterr().err == (
        "a real error\nUSDT: not kineto's format, kept\nno newline at the end|after"
    )


def test_profiler_chatter_is_hidden_unless_verbose(tmp_path, capfd):
    """Kineto's ``USDT: ... profiler_start/stop`` lines are C++ writes to fd 2."""
    printed = {}
    for verbose in (False, True):
        with StepProfiler(
            tmp_path / str(verbose), 0, wait=0, warmup=1, active=1, verbose=verbose
        ) as prof:
            _fake_steps(prof, 3)
        printed[verbose] = capfd.readouterr().err
    assert "USDT" not in printed[False], printed[False]
    if "USDT" not in printed[True]:
        pytest.skip("this torch build prints no USDT lines: nothing to hide")
    assert "profiler_start" in printed[True]


@pytest.mark.parametrize("ops", [False, True])
def test_user_spans_only_unless_ops(tmp_path, ops):
    """By default only record_function spans (and memory events) are recorded, not the aten
    ops inside them; ``ops`` records those too. torch's enable call is restored afterwards."""
    import torch.autograd.profiler as autograd_profiler

    enable = autograd_profiler._enable_profiler
    with StepProfiler(tmp_path, 0, wait=0, warmup=1, active=1, ops=ops, profile_memory=True) as p:
        _fake_steps(p, 2)
    assert autograd_profiler._enable_profiler is enable
    trace = json.loads((tmp_path / "rank0.pt.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"PP:STEP:1", "PP:0F0", "PP:0B0", "[memory]"} <= names
    assert any(str(n).startswith("aten::") for n in names) == ops
    assert trace["vpipe"]["profiler_ops"] == ("all" if ops else "user spans")


def _no_cuda_reads(monkeypatch):
    """CUDA "available", and any read of its statistics fails the test."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("max_memory_allocated", "reset_peak_memory_stats", "memory_allocated",
                 "synchronize", "current_device"):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: pytest.fail("read CUDA"))


def test_cpu_run_on_a_cuda_machine_never_reads_cuda_memory(tmp_path, monkeypatch):
    _no_cuda_reads(monkeypatch)
    with StepProfiler(tmp_path, 0, wait=0, warmup=1, active=1, device="cpu") as prof:
        _fake_steps(prof, 2)
    trace = json.loads((tmp_path / "rank0.pt.trace.json").read_text())
    assert {s["what"] for s in trace["vpipe_samples"]} == {"rss", "activations"}


def test_memory_is_read_from_the_runs_own_device_by_index(monkeypatch):
    import torch

    from vpipe.trace import record

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: calls.append(d) or 77)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append(d))
    assert record.cuda_device("cpu") is None
    assert record.cuda_device("cuda:1") == torch.device("cuda", 1)
    assert record.cuda_device("cuda") == torch.device("cuda", 3)  # the current device, named
    assert record.take_cuda_peak(record.cuda_device("cuda:1")) == 77
    assert calls == [torch.device("cuda", 1)] * 2  # never the default (None: cuda:0's)
