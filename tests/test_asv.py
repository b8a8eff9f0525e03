"""The asv suite: ``asv check`` discovers it, and a quick one-benchmark ``asv run`` on the
installed tree (``--python=same``) records a real value. Runs against a copy of the root
``asv.conf.json`` whose results go to a temporary directory, with a temporary HOME for asv's
machine file, and the parameter grid narrowed to one point. The virtualenv that ``asv
continuous`` makes is kept in pytest's cache between runs, under a key of everything that
decides its contents (the asv config, both commits' ``pyproject.toml``, this Python): a change
to any of them makes a fresh one."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.asv_false_alarms import asv_config

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("asv") is None, reason="asv not installed")


def _asv(
    tmp_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    env_dir: Path | None = None,
):
    conf = json.loads((ROOT / "asv.conf.json").read_text())
    assert conf["benchmark_dir"] == "benchmarks" and conf["results_dir"] == "results/asv"
    path = asv_config(ROOT, tmp_path)
    if env_dir is not None:
        path.write_text(json.dumps({**json.loads(path.read_text()), "env_dir": str(env_dir)}))
    full_env = {**os.environ, "HOME": str(tmp_path / "home"), **(env or {})}
    (tmp_path / "home").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "asv", *args, "--config", str(path)]
    return subprocess.run(
        cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def test_asv_check(tmp_path):
    res = _asv(tmp_path, "check", "--python=same")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "No problems found" in res.stdout


def test_asv_quick_run_records_a_value(tmp_path):
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    if not commit:
        pytest.skip("not a git checkout: asv needs a commit hash")
    machine = _asv(tmp_path, "machine", "--yes", "--machine", "vpipe-test")
    assert machine.returncode == 0, machine.stdout + machine.stderr
    res = _asv(
        tmp_path,
        "run",
        "--python=same",
        "--quick",
        "--machine",
        "vpipe-test",
        "--set-commit-hash",
        commit,
        "--bench",
        "track_normalised_step_in_ref_units",
        # a busy shared host records no timing (checked below, in process): recorded anyway
        env={"VPIPE_ASV_SCHEDULES": "zbv", "VPIPE_ASV_MICROBATCHES": "2", "VPIPE_ASV_BLOCKS": "1",
             "VPIPE_ASV_ALLOW_BUSY": "1"},
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    files = [
        p for p in (tmp_path / "results" / "vpipe-test").glob("*.json") if p.name != "machine.json"
    ]
    assert len(files) == 1, res.stdout
    data = json.loads(files[0].read_text())
    key = "benchmarks.PipelineCPU.track_normalised_step_in_ref_units"
    result = data["results"][key]
    value = result[0][0] if isinstance(result, list) else result["result"][0]
    # the step in units of the host-speed reference: a positive, finite ratio
    assert isinstance(value, float) and math.isfinite(value) and value > 0, res.stdout


def _kept_env_dir(request, tmp_path: Path, commits: list[str]) -> Path:
    """Where asv keeps its virtualenvs for ``commits``: a folder of pytest's cache reused while
    the asv config, the commits' ``pyproject.toml`` and this Python are unchanged (installing
    torch and every dependency takes most of a minute and a half), emptied when any changes;
    ``tmp_path`` when pytest runs without its cache."""
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return tmp_path / "env"
    key = hashlib.sha256((ROOT / "asv.conf.json").read_bytes() + sys.version.encode())
    for commit in commits:
        show = subprocess.run(["git", "show", f"{commit}:pyproject.toml"], cwd=ROOT,
                              capture_output=True, check=True)  # fmt: skip
        key.update(show.stdout)
    folder = cache.mkdir("asv-env")
    stamp = folder / "key"
    if not stamp.exists() or stamp.read_text() != key.hexdigest():
        shutil.rmtree(folder)
        folder.mkdir()
        stamp.write_text(key.hexdigest())
    return folder / "env"


def test_asv_continuous_builds_both_commits_with_every_dependency(tmp_path, request):
    """`asv continuous` as its users run it: asv makes its own virtualenv (torch pinned to the
    local CPU build, the project installed with all its dependencies), builds and installs two
    commits and benchmarks both. Fails if the environment lacks a dependency."""
    rev = subprocess.run(
        ["git", "rev-parse", "HEAD~1", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    assert rev.returncode == 0, "asv continuous needs two commits: " + rev.stderr
    base, tip = rev.stdout.split()
    machine = _asv(tmp_path, "machine", "--yes", "--machine", "vpipe-test")
    assert machine.returncode == 0, machine.stdout + machine.stderr
    res = _asv(
        tmp_path,
        "continuous", "--machine", "vpipe-test", "--quick", "--factor", "100",
        "--bench", r"ZBV64x1024.track_simulate(_in_ref_units)?$", base, tip,
        timeout=1200, env_dir=_kept_env_dir(request, tmp_path, [base, tip]),
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "failed" not in out.lower() and "Traceback" not in out, out[-4000:]
    results = sorted((tmp_path / "results" / "vpipe-test").glob("*.json"))
    runs = [json.loads(p.read_text()) for p in results if p.name != "machine.json"]
    assert sorted(r["commit_hash"] for r in runs) == sorted([base, tip])
    for r in runs:  # the name carries its unit since a commit that may lie between the two
        assert r["params"]["torch"] == "2.13.0"
        (name,) = (k for k in r["results"] if re.search(r"ZBV64x1024\.track_simulate(_in_ref_units)?$", k))
        value = r["results"][name][0][0]
        assert isinstance(value, float) and value > 0


def test_a_sweep_on_a_busy_host_records_no_timing():
    """Under a busy core the normalised step over-corrects (0.89x for the same code), so the
    suite takes no timing from such a sweep, saying why."""
    from benchmarks.benchmarks import busy_host

    quiet = [{"other_cores": 0.02}, {"other_cores": 0.1}, {"other_cores": 0.05}]
    busy = [{"other_cores": 0.9}, {"other_cores": 0.85}, {"other_cores": 0.1}]
    assert busy_host(quiet) is None and busy_host([]) is None
    why = busy_host(busy)
    assert why is not None and "0.85 cores" in why and "VPIPE_ASV_ALLOW_BUSY" in why


def test_each_round_gives_one_sample_and_a_busy_round_no_timing(tmp_path, monkeypatch, capsys):
    """asv keeps samples across interleaved rounds (each a fresh cache); without interleaving
    every round reads the same cache, which counts once; a busy sweep gives no timing sample."""
    from benchmarks.benchmarks import BUSY, ROUNDS, PipelineCPU

    assert ROUNDS >= 7  # Mann-Whitney can reach p < 0.002 from 7 rounds
    monkeypatch.chdir(tmp_path)  # asv runs the benchmarks in the round's cache directory
    cache = {"zbv/4": {"normalised_step_in_ref_units": 9.5, "peak_bytes_per_rank": 1.0}}
    bench = PipelineCPU()
    first = bench.track_normalised_step_in_ref_units(cache, "zbv", 4)
    assert first == {"samples": [9.5], "number": 1}
    assert bench.track_normalised_step_in_ref_units(cache, "zbv", 4) == {"samples": [], "number": 1}
    assert bench.track_peak_bytes_per_rank(cache, "zbv", 4)["samples"] == [1.0]
    (tmp_path / "busy").mkdir()
    monkeypatch.chdir(tmp_path / "busy")  # the next round's cache directory
    busy = {BUSY: "other processes kept 0.90 cores busy", **cache}
    assert bench.track_normalised_step_in_ref_units(busy, "zbv", 4) == {"samples": [], "number": 1}
    assert "no sample this round: other processes kept 0.90 cores busy" in capsys.readouterr().err
    # the busy host moves no byte: the round's peak memory is still a sample
    assert bench.track_peak_bytes_per_rank(busy, "zbv", 4)["samples"] == [1.0]
