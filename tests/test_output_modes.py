"""Files vpipe writes follow the umask (0644 under umask 022), and a staged output directory is
swapped in whole: the previous output or the new one, never a mix, never a temporary left."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from vpipe import outputs
from vpipe.outputs import atomic_write, staged_dir

DATA = Path(__file__).parent / "data"


def _modes(root: Path) -> dict[str, int]:
    """Permission bits of every file and directory under ``root`` (itself included)."""
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.stat().st_mode) for p in paths}


def test_files_of_every_writing_command_follow_umask_022(tmp_path):
    def vpipe(*argv: str) -> None:
        r = subprocess.run([sys.executable, "-m", "vpipe", *argv], capture_output=True,
                           text=True, timeout=120, preexec_fn=lambda: os.umask(0o022))  # fmt: skip
        assert r.returncode == 0, (argv, r.stderr)

    vpipe("show", "zbv", "-p", "2", "-m", "4", "--csv", str(tmp_path / "show.csv"))
    vpipe("simulate", "zbv", "-p", "2", "-m", "4", "--trace", str(tmp_path / "sim.json"))
    vpipe("plan", "-p", "2", "--batch", "8", "--memory", "100units",
          "--cost", "f=1,b=1,w=1", "--plot", str(tmp_path / "plan.png"))  # fmt: skip
    vpipe("trace", str(DATA / "torch_zbv"), "-o", str(tmp_path / "ev.parquet"),
          "--store", str(tmp_path / "store"), "--batch", "8")  # fmt: skip
    vpipe("report", str(tmp_path / "store"), "-o", str(tmp_path / "report.html"))
    modes = {}
    for p in tmp_path.iterdir():
        modes.update(_modes(p))
    files = {k: v for k, v in modes.items() if (tmp_path / k).is_file()}
    dirs = {k: v for k, v in modes.items() if (tmp_path / k).is_dir()}
    written = {"show.csv", "sim.json", "plan.png", "ev.parquet", "report.html", "report.md"}
    assert written <= set(files), sorted(files)
    assert any(k.startswith("store/runs/") for k in files), sorted(files)
    assert {k: oct(v) for k, v in files.items() if v != 0o644} == {}
    assert {k: oct(v) for k, v in dirs.items() if v != 0o755} == {}


def test_atomic_write_follows_umask(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "x.txt", lambda p: p.write_text("x"))
        with staged_dir(tmp_path / "out") as d:
            (d / "f").write_text("f")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.txt").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750


def test_staged_dir_swaps_in_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(ZeroDivisionError), staged_dir(out) as d:
        (d / "new.txt").write_text("half")
        raise ZeroDivisionError
    assert sorted(os.listdir(out)) == ["old.txt"]
    with pytest.raises(KeyboardInterrupt, match="kept as it was"), staged_dir(out) as d:
        (d / "new.txt").write_text("half")
        raise KeyboardInterrupt
    assert sorted(os.listdir(out)) == ["old.txt"]
    with staged_dir(out, keep=True) as d:  # --append: onto a copy
        (d / "more.txt").write_text("more")
    assert sorted(os.listdir(out)) == ["more.txt", "old.txt"]
    with staged_dir(out) as d:  # --force: replaced
        (d / "new.txt").write_text("new")
    assert sorted(os.listdir(out)) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging or old copy left


def test_ctrl_c_just_after_the_staging_directory_is_made_leaves_none(tmp_path, monkeypatch):
    """A Ctrl-C that lands once the staging directory exists but before staged_dir has its
    name (a process descheduled there, on a loaded host) still removes it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    mkdtemp = outputs.tempfile.mkdtemp

    def made_then_interrupted(*args, **kwargs) -> str:
        made = mkdtemp(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return made

    monkeypatch.setattr(outputs.tempfile, "mkdtemp", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt, match="kept as it was"):
        with staged_dir(out) as d:
            (d / "new.txt").write_text("new")
    assert sorted(os.listdir(out)) == ["old.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_ctrl_c_during_the_swap_is_held_until_it_is_done(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    swap = outputs._swap_in

    def swap_interrupted(new: Path, path: Path) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # arrives mid-swap
        swap(new, path)

    monkeypatch.setattr(outputs, "_swap_in", swap_interrupted)
    with pytest.raises(KeyboardInterrupt, match="holds this run's complete output"):
        with staged_dir(out) as d:
            (d / "new.txt").write_text("new")
    assert sorted(os.listdir(out)) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]
