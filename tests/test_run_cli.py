"""``vpipe run``: validation in-process, then a few real runs (local spawn and torchrun)."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from vpipe.cli import main
from vpipe.errors import PipelineError, VpipeError
from vpipe.models import build_model
from vpipe.sweep.cli_lists import parse_sizes
from vpipe.sweep.harness import check_against_reference

TINY = "d_model=16,d_hidden=32"


@pytest.fixture
def no_spawn(monkeypatch):
    import vpipe.runtime.launch as launch

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a process was spawned"))


def test_run_csv_schedule_gpt_with_check_and_profile(tmp_path):
    """A schedule from a torch-format CSV, local spawn, GPT model, --check and --profile."""
    from vpipe.ir.lowering import lower
    from vpipe.schedules import make_schedule

    csv = tmp_path / "gpipe2.csv"
    lower(make_schedule("gpipe", 2, 2)).to_csv(csv)
    prof = tmp_path / "prof"
    sizes = "vocab=32,d_model=16,n_heads=2,n_layers=2,seq_len=8"
    argv = [str(csv), "--batch", "4", "--steps", "3", "--model", "gpt", "--sizes", sizes]
    # ranks print to the forkserver's stdout, so this in-process run is judged by its exit
    # status (0: every --check comparison passed) and its files; stdout: the torchrun test
    assert main(["run", *argv, "--check", "--profile", str(prof)]) == 0
    for rank in (0, 1):
        trace = json.loads((prof / f"rank{rank}.pt.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert any(str(n).startswith("PP:") for n in names)
        # the split probe's (I + W) / B of stage 1, for analyze --predict
        assert trace["vpipe"]["split_backward_ratio"] > 0
        # and each stage's forward alone, what a full recomputation reruns
        alone = trace["vpipe"]["forward_alone_us"]
        assert len(alone) == 2 and all(t > 0 for t in alone), alone


def test_profiled_run_is_quiet_unless_verbose(tmp_path):
    """torch's profiler prints ``USDT: ... profiler_start/stop`` from C++ on every rank; a
    profiled run hides them, ``--verbose`` shows them (real processes: spawned ranks)."""
    out = {}
    for flag in ("", "--verbose"):
        argv = ["zbv", "-p", "2", "-m", "4", "--batch", "8", "--steps", "2", "--sizes", TINY]
        argv += ["--profile", str(tmp_path / (flag or "quiet"))] + ([flag] if flag else [])
        r = subprocess.run(
            [sys.executable, "-m", "vpipe", "run", *argv],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        out[flag] = r.stdout + r.stderr
    assert "USDT" not in out[""], out[""]
    assert "summary: zbv" in out[""]
    assert sorted(p.name for p in (tmp_path / "quiet").iterdir()) == [
        "rank0.pt.trace.json",
        "rank1.pt.trace.json",
    ]
    if "USDT" not in out["--verbose"]:
        pytest.skip("this torch build prints no USDT lines, so there is nothing to hide")
    assert out["--verbose"].count("profiler_start") == 2  # one per rank


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_run_under_torchrun_joins_the_job():
    r = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "vpipe", "run",
         "dualpipev", "-p", "2", "-m", "4", "--batch", "8", "--steps", "3", "--sizes", TINY,
         "--check"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    steps = re.findall(r"^step (\d+): ([\d.]+) ms  loss ([\d.]+)$", r.stdout, re.M)
    assert [s[0] for s in steps] == ["0", "1", "2"], r.stdout
    assert len({s[2] for s in steps}) == 1  # same batch and parameters: same loss every step
    assert re.search(r"check: OK \(\d+ comparisons", r.stdout)
    summary = r"summary: dualpipev impl=vpipe ranks=2 stages=4 microbatches=4 .* samples/s"
    assert re.search(summary, r.stdout), r.stdout


def test_check_reports_a_wrong_gradient_by_stage_and_parameter():
    model = build_model("mlp", 2, d_model=8, d_hidden=8, n_blocks=2)
    reference = model.reference_model()
    x, y = model.make_batch(4)
    out = model.stages[1](model.stages[0](x))
    losses = [model.loss_fn(o, t) for o, t in zip(out.chunk(2), y.chunk(2), strict=True)]
    (sum(losses) / 2).backward()
    found = check_against_reference(reference, model, [0, 1], losses, x, y, 2, 1e-5)
    assert found and all(f["ok"] for f in found)
    model = build_model("mlp", 2, d_model=8, d_hidden=8, n_blocks=2)
    reference = model.reference_model()
    out = model.stages[1](model.stages[0](x))
    losses = [model.loss_fn(o, t) for o, t in zip(out.chunk(2), y.chunk(2), strict=True)]
    (sum(losses) / 2).backward()
    model.stages[1].pieces[0].fc2.weight.grad[0, 0] += 1e-3
    found = check_against_reference(reference, model, [0, 1], losses, x, y, 2, 1e-5)
    bad = [f for f in found if not f["ok"]]
    assert [f["where"] for f in bad] == ["stage 1 parameter pieces.0.fc2.weight"]
    assert bad[0]["err"] > 1e-5


def test_check_failure_is_loud(capsys):
    from vpipe.commands.run import _print_check

    good = {"where": "losses", "what": "per-microbatch losses", "err": 0.0, "ok": True}
    bad = {"where": "stage 3 parameter pieces.0.fc1.bias", "what": "gradient", "err": 0.25}
    bad["ok"] = False
    _print_check([(0, [good]), (1, [bad])], [(1, bad)])
    err = capsys.readouterr().err
    assert "MISMATCH rank 1 stage 3 parameter pieces.0.fc1.bias" in err
    assert "2.500e-01" in err and "FAILED (1 of 2 comparisons)" in err


def test_validation_errors_before_spawn(no_spawn, capsys):
    cases = [
        (["zbv", "-p", "2", "-m", "4", "--batch", "6"], "does not split into 4"),
        (["zbv", "-p", "2", "--batch", "12"], "does not split into 8"),  # default M = 8
        (["zbv", "-p", "2", "-m", "4", "--batch", "8", "--sizes", "n_blocks=2"], "cannot split"),
        (["zbv", "-p", "2", "-m", "4", "--batch", "8", "--sizes", "depth"], "NAME=INT"),
        (["gpipe", "-p", "2", "-m", "2", "--batch", "4", "--impl", "torch", "-v", "2"], "stage"),
    ]  # -p 0: argparse's own error, worded as vpipe show's (tests/test_report_words.py)
    for argv, message in cases:
        assert main(["run", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
        assert err.count("\n") == 1, err  # one line, no traceback


def test_parse_sizes():
    assert parse_sizes("d_model=64, n_blocks=8") == {"d_model": 64, "n_blocks": 8}
    assert parse_sizes("") == {}
    with pytest.raises(VpipeError, match="NAME=INT"):
        parse_sizes("d_model=-1")


def test_cuda_ranks_share_a_gpu_only_with_gloo(monkeypatch):
    """NCCL needs one GPU per local rank; with gloo, rank r runs on cuda:(r mod GPUs)."""
    import torch

    from vpipe.runtime.launch import check_gpus, local_device

    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    check_gpus(2, "gloo")
    with pytest.raises(VpipeError, match="one CUDA device per local rank.*--backend gloo"):
        check_gpus(2, "nccl")
    assert [local_device("cuda", r) for r in (0, 1)] == [torch.device("cuda", 0)] * 2
    assert picked == [0, 0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(VpipeError, match="no CUDA device"):
        check_gpus(1, "gloo")


@pytest.mark.parametrize("command", ["run", "bench"])
def test_torch_baseline_on_cuda_over_gloo_is_refused_before_any_rank(
    command, monkeypatch, capsys, tmp_path
):
    """torch.distributed.pipelining hands CUDA tensors to gloo, which aborts the rank: --impl
    torch there is one line, before the GPU check (a stand-in that fails if reached) and
    before any rank starts."""
    from vpipe.cli import main
    from vpipe.runtime import launch

    def reached(*_):
        raise AssertionError("the GPU check ran before the refusal")

    monkeypatch.setattr(launch, "check_gpus", reached)
    monkeypatch.setattr(launch, "spawn", reached)
    args = [command, "1f1b", "--impl", "torch", "--device", "cuda", "--backend", "gloo"]
    if command == "bench":
        args = ["bench", "--schedules", "1f1b", "--impl", "torch", "--device", "cuda",
                "--backend", "gloo", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--backend nccl" in err[0] and "gloo" in err[0]


def test_bench_on_cuda_over_gloo_leaves_the_torch_baseline_out(monkeypatch, capsys, tmp_path):
    """A sweep of both implementations keeps vpipe's configs and says in one line why the
    torch baseline is left out (the GPU check and the sweep are stand-ins)."""
    from vpipe.cli import main
    from vpipe.runtime import launch
    from vpipe.sweep import blocks

    swept = []
    monkeypatch.setattr(launch, "check_gpus", lambda *_: None)
    monkeypatch.setattr(blocks, "run_blocks", lambda spec, _: swept.append(spec) or [])
    args = ["bench", "--quick", "--schedules", "1f1b,zbv", "--device", "cuda", "--backend",
            "gloo", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 0
    (spec,) = swept
    assert spec.impls == ("vpipe",)
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("torch baseline left out:") for line in out) == 1


def test_torchrun_rank_without_its_own_gpu_is_refused_for_nccl(monkeypatch):
    """Under torchrun a local rank past the GPU count gets a one-line error naming the rank
    and the fix for NCCL, before any process group is made (gloo shares the GPUs instead)."""
    import torch

    from vpipe.runtime.launch import init_from_env

    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(PipelineError, match=r"rank 1: local rank 1 .* 1 CUDA device.*gloo"):
        init_from_env("cuda")


def test_bf16_run_checks_against_the_float32_reference(tmp_path):
    """--dtype bf16: stages, messages and gradients in bf16 on two gloo ranks, judged against
    the float32 reference with bf16's tolerance; the trace says which precision ran."""
    prof = tmp_path / "prof"
    argv = ["run", "zbv", "-p", "2", "-m", "4", "--batch", "8", "--steps", "2", "--sizes", TINY,
            "--dtype", "bf16", "--check", "--profile", str(prof)]  # fmt: skip
    assert main(argv) == 0
    meta = json.loads((prof / "rank0.pt.trace.json").read_text())["vpipe"]
    assert meta["dtype"] == "bf16"


def test_the_precision_defaults_by_device_and_names_a_bad_one():
    from vpipe.ir.lowering import lower
    from vpipe.schedules import make_schedule
    from vpipe.sweep.harness import CHECK_TOL, RankSpec

    s = lower(make_schedule("1f1b", 2, 2))
    assert RankSpec(s).precision == "fp32" and RankSpec(s, device="cuda").precision == "bf16"
    assert CHECK_TOL["fp32"] < CHECK_TOL["fp16"] and CHECK_TOL["fp32"] < CHECK_TOL["bf16"]
    with pytest.raises(VpipeError, match="unknown dtype 'fp8'"):
        RankSpec(s, dtype="fp8").check(build=False)


def _threads(rank: int, n_ranks: int) -> int:
    import torch

    return torch.get_num_threads()


def test_ranks_divide_vpipe_cores_and_a_bad_value_is_one_line(monkeypatch, capsys):
    """VPIPE_CORES (a parallel test worker's share of the host) is what the ranks divide for
    their torch threads; a value that is not a positive whole number is refused in one line
    naming it, before any rank starts."""
    import os

    from vpipe.runtime.launch import spawn, usable_cores

    monkeypatch.delenv("VPIPE_CORES", raising=False)
    assert usable_cores() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("VPIPE_CORES", "6")
    assert usable_cores() == 6
    assert spawn(_threads, 2, timeout_s=120) == [3, 3]
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("VPIPE_CORES", bad)
        with pytest.raises(PipelineError, match=rf"^VPIPE_CORES='{bad}': expected a whole number"):
            spawn(_threads, 1)
        assert main(["run", "zbv", "-p", "2", "-m", "4", "--steps", "1"]) == 2
        assert f"VPIPE_CORES='{bad}'" in capsys.readouterr().err
