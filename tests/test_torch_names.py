"""torch's and torchtitan's schedule names mean vpipe's families (any case), and `--impl torch`
runs a CSV schedule through torch's own CSV runtime, as torchtitan does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vpipe.cli import main
from vpipe.errors import ScheduleError
from vpipe.schedules import catalogue, make_schedule
from vpipe.sweep.driver import SweepSpec


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("DualPipeV", "dualpipev"),
        ("ZBVZeroBubble", "zbv"),
        ("ScheduleZBVZeroBubble", "zbv"),
        ("Interleaved1F1B", "interleaved-1f1b"),
        ("interleaved1f1b", "interleaved-1f1b"),
        ("GPipe", "gpipe"),
        ("1F1B", "1f1b"),
        ("LoopedBFS", "looped-bfs"),
        ("InterleavedZeroBubble", "zb-h1"),
        ("ZBV", "zbv"),
    ],
)
def test_torch_names_are_aliases(spelling, name):
    assert catalogue.canonical(spelling) == name
    assert make_schedule(spelling, 2, 4).name == name
    assert SweepSpec(schedules=(spelling,)).schedules == (name,)


def test_unknown_names_and_clashing_aliases_are_refused(capsys):
    assert catalogue.canonical("Zero") == "Zero"
    with pytest.raises(ScheduleError, match="unknown schedule 'Zero'"):
        make_schedule("Zero", 2, 4)
    zbv = catalogue.get("zbv")
    clash = catalogue.Family("zbv-copy", zbv.generator, "x", "v", 2, aliases=("DualPipeV",))
    with pytest.raises(ScheduleError, match="'dualpipev' already means dualpipev"):
        catalogue.register(clash)
    assert main(["show", "DualPipeV", "-p", "2", "-m", "4"]) == 0
    assert capsys.readouterr().out.startswith("dualpipev: 2 ranks, 4 stages")


def test_torch_runs_a_csv_schedule_through_its_runtime(tmp_path):
    csv = tmp_path / "zbv.csv"
    assert main(["show", "zbv", "-p", "2", "-m", "4", "--csv", str(csv)]) == 0
    r = subprocess.run(
        [sys.executable, "-m", "vpipe", "run", str(csv), "--impl", "torch", "--batch", "8",
         "--steps", "2", "--sizes", "d_model=16,d_hidden=32", "--check"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "check: OK" in r.stdout and "impl=torch" in r.stdout
