"""What a newcomer trips over (issue 21): output paths checked before ranks start, torchrun's
failure report naming vpipe's cause, runtime knobs named in comparisons, results/asv/ ignored."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from vpipe.cli import main
from vpipe.report.knobs import knob_differences, knob_text

ROOT = Path(__file__).resolve().parents[1]


def test_run_checks_profile_dir_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    from vpipe.runtime import launch

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("ranks were started"))
    (tmp_path / "f").write_text("a file")
    argv = ["run", "zbv", "-p", "2", "-m", "4", "--profile", str(tmp_path / "f" / "traces")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vpipe run: error: --profile ") and "a file is in the way" in err, err


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_failure_report_names_vpipes_cause(tmp_path):
    r = subprocess.run(
        ["torchrun", "--nproc-per-node", "2", "-m", "vpipe", "run", "zbv", "-p", "3", "-m", "4"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert r.returncode != 0
    cause = "vpipe run: error: torchrun started 2 processes but the schedule has 3 ranks"
    assert f"traceback : {cause}" in r.stderr, r.stderr[-2000:]


def test_comparison_names_the_knobs_that_differ():
    a = {"recv_lookahead": 1, "bundle_messages": True, "post_thread": None}
    b = {**a, "recv_lookahead": 2, "bundle_messages": False}
    assert knob_text(a) == "recv_lookahead=1 bundle_messages=True post_thread=None"
    assert knob_differences([a, b], ["A", "B"]) == [
        "recv_lookahead (--recv-lookahead): 1 in A, 2 in B",
        "bundle_messages (--no-bundle): True in A, False in B",
    ]
    assert knob_differences([a, dict(a)], ["A", "B"]) == []
    # a sweep from before --cpu-allocator ran on the C library's malloc
    cached = {**a, "cpu_allocator": "cached"}
    assert knob_differences([a, cached], ["A", "B"]) == [
        "cpu_allocator (--cpu-allocator): system in A, cached in B"
    ]
    assert knob_differences([{**a, "cpu_allocator": "system"}, a], ["A", "B"]) == []


def test_asv_results_are_ignored_by_git():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "check-ignore", "-q", "results/asv/machine.json"], cwd=ROOT)
    assert r.returncode == 0
