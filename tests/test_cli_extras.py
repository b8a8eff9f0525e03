"""Small CLI promises: --version, `vpipe runs`, --quick keeping the flags a user gives, -p/-m
on bench, plots leaving the caller's matplotlib backend alone, and a torch floor that has every
schedule class vpipe drives."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import vpipe
from vpipe.cli import main
from vpipe.trace.store import Store

ROOT = Path(__file__).parent.parent


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"vpipe {vpipe.__version__}"


def test_runs_lists_a_store(tmp_path, capsys):
    store = Store(tmp_path)
    for rid, sched in (("b-zbv", "zbv"), ("b-1f1b", "1f1b")):
        store.append_run(
            {"run_id": rid, "schedule": sched, "source": "measured", "step_time_s": 0.5}
        )
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "b-zbv" in out and "b-1f1b" in out and "2 runs in" in out
    assert main(["runs", str(tmp_path / "nope")]) == 2
    assert "not a results store" in capsys.readouterr().err


@pytest.fixture
def captured_spec(monkeypatch):
    import vpipe.sweep.driver

    seen = {}

    def fake_sweep(spec, bench_id=None):
        seen["spec"] = spec
        return []  # as on a non-coordinating torchrun rank: nothing to write

    monkeypatch.setattr(vpipe.sweep.driver, "run_sweep", fake_sweep)
    return seen


def test_quick_keeps_given_flags_and_bench_takes_p_m(captured_spec, tmp_path):
    argv = [
        "bench",
        "--quick",
        "--schedules",
        "1f1b,zbv",
        "-m",
        "2",
        "-p",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    spec = captured_spec["spec"]
    assert spec.schedules == ("1f1b", "zbv") and spec.microbatches == (2,) and spec.ranks == 2
    assert spec.batch == 16 and spec.rounds == 3  # the quick defaults for what was not given
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    assert captured_spec["spec"].schedules == ("interleaved-1f1b", "zbv")


def test_plots_leave_the_matplotlib_backend_alone():
    code = (
        "import matplotlib; matplotlib.use('svg')\n"
        "import pandas as pd\n"
        "from vpipe.report.plots import plot_throughput, to_png\n"
        "steps = pd.DataFrame({'schedule': ['zbv', 'interleaved-1f1b'], 'impl': ['vpipe'] * 2,"
        " 'microbatches': [4, 4], 'samples_per_s': [10.0, 9.0], 'round': [0, 0], 'step': [0, 0]})\n"
        "png = to_png(plot_throughput(steps))\n"
        "assert png[:4] == b'\\x89PNG', png[:8]\n"
        "print(matplotlib.get_backend())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "svg"


def test_torch_floor_has_dualpipev():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (floor,) = [
        re.fullmatch(r"torch>=(\d+)\.(\d+)", d).groups() for d in deps if d.startswith("torch")
    ]
    assert tuple(map(int, floor)) >= (2, 9)  # torch.distributed.pipelining.ScheduleDualPipeV
