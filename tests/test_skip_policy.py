"""The skip policy: under VPIPE_STRICT_SKIPS=1 a skip for a reason outside the allowed list
fails the run; an allowed one (no Chromium, no GPU) does not; without the variable nothing
changes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _pytest(
    tmp_path: Path, reason: str, strict: bool, *flags: str
) -> subprocess.CompletedProcess:
    (tmp_path / "test_x.py").write_text(
        f"import pytest\n\n@pytest.mark.skip(reason={reason!r})\ndef test_a():\n    pass\n\n"
        "def test_b():\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(HERE), "VPIPE_STRICT_SKIPS": "1" if strict else "0"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "skip_policy", "-p", "no:cacheprovider",
         *flags, str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("reason", "strict", "rc"),
    [
        ("torchrun not on PATH", True, 1),
        ("asv not installed", False, 0),
        ("chromium not installed (apt-get install chromium)", True, 0),
        ("needs a GPU", True, 0),
    ],
)
def test_disallowed_skip_fails_only_when_strict(tmp_path, reason, strict, rc):
    r = _pytest(tmp_path, reason, strict)
    assert r.returncode == rc, r.stdout + r.stderr
    if rc:
        assert f"skip not allowed in CI: test_x.py::test_a: {reason}" in r.stdout


def test_a_disallowed_skip_fails_the_run_on_parallel_workers_too(tmp_path):
    """make test runs the suite on pytest-xdist workers: the skips they report reach the
    policy in the controlling process, which fails the run and names the test."""
    r = _pytest(tmp_path, "torchrun not on PATH", True, "-n", "2", "-p", "no:benchmark")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "skip not allowed in CI: test_x.py::test_a: torchrun not on PATH" in r.stdout
    assert "1 passed, 1 skipped" in r.stdout
