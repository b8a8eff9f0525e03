"""Output paths are checked before any work: a file where a directory should be (or the other
way round), a directory under a file, a non-empty --out without --append/--force; every such
case is one line, nothing is launched or written, and no temporary file is left behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vpipe.cli import main
from vpipe.outputs import OutputError, atomic_write, check_output_dir, check_output_file


@pytest.fixture
def no_sweep(monkeypatch):
    import vpipe.sweep.driver

    calls = []
    monkeypatch.setattr(vpipe.sweep.driver, "run_sweep", lambda spec, bench_id=None: calls.append(1) or [])
    return calls


def _bench(out, *extra):
    return main(["bench", "--quick", "--impl", "vpipe", "--out", str(out), *extra])


def test_bench_refuses_bad_out_before_launch(tmp_path, capsys, no_sweep):
    a_file = tmp_path / "f"
    a_file.write_text("keep me")
    full = tmp_path / "full"
    full.mkdir()
    (full / "old.txt").write_text("keep me")
    cases = [
        (a_file, "is a file, not a directory"),
        (a_file / "sub", "a file is in the way"),
        (full, "is not empty: use --append"),
    ]
    for out, message in cases:
        assert _bench(out) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
    assert not no_sweep  # nothing was launched
    assert a_file.read_text() == "keep me" and (full / "old.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["f", "full"]  # no probe or temp file left
    assert _bench(full, "--append") == 0 and _bench(full, "--force") == 0 and len(no_sweep) == 2
    assert (full / "old.txt").exists()  # --force clears only once a sweep has results


def test_output_helpers(tmp_path):
    with pytest.raises(OutputError, match="is a directory"):
        check_output_file(tmp_path)
    assert check_output_file(tmp_path / "new" / "x.html").parent.is_dir()
    assert check_output_dir(tmp_path / "empty") == tmp_path / "empty"
    with pytest.raises(ZeroDivisionError):
        atomic_write(tmp_path / "y.txt", lambda p: (p.write_text("half"), 1 / 0))
    assert sorted(os.listdir(tmp_path)) == ["empty", "new"]
    atomic_write(tmp_path / "y.txt", lambda p: p.write_text("whole"))
    assert (tmp_path / "y.txt").read_text() == "whole"


def test_commands_refuse_directories_as_files_in_a_real_process(tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    cases = [
        (["trace", str(tmp_path), "-o", str(d)], "-o " + str(d) + " is a directory"),
        (["report", str(tmp_path), "-o", str(d)], "-o " + str(d) + " is a directory"),
        (["bench", "--quick", "--out", str(tmp_path)], "is not empty"),
        (["show", "zbv", "-p", "2", "-m", "4", "--csv", str(d)], "--csv " + str(d) + " is a dir"),
        (["simulate", "zbv", "--trace", str(d)], "--trace " + str(d) + " is a directory"),
    ]
    for argv, message in cases:
        r = subprocess.run([sys.executable, "-m", "vpipe", *argv], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        assert r.returncode == 2, (argv, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["adir"]
