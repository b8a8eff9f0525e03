"""``vpipe ab`` against versions from before it existed (whole launches in turn), and what a
session says of its versions: the same commit twice, and which config each way to settle
is for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

from vpipe.commands.ab import same_version
from vpipe.report.ab_report import ab_headline
from vpipe.sweep.envs import Version
from vpipe.sweep.launched import knows_flag, method, store_message

ROOT = Path(__file__).resolve().parents[1]
# a commit of this repository from before vpipe ab and vpipe bench --paced existed
OLD = "e2c9ce6"


def _version(label: str, name: str, checkout: Path, commit: str | None = None) -> Version:
    return Version(label, name, checkout, Path(sys.executable), commit, True)


def test_the_same_commit_twice_is_said_to_be_an_a_a_comparison(tmp_path):
    a = _version("A", "main", tmp_path / "x", "61454d2868a3" + "0" * 28)
    b = _version("B", "HEAD", tmp_path / "y", a.commit)
    line = same_version({"A": a, "B": b})
    assert line == "A (main) and B (HEAD) are the same commit, 61454d2868a3: an A/A comparison, of noise only"
    other = _version("B", "HEAD~1", tmp_path / "z", "1" * 40)
    assert same_version({"A": a, "B": other}) == ""


def test_to_settle_names_the_config_each_number_of_pairs_is_for():
    rows = [
        {"schedule": s, "M": 8, "impl": "vpipe", "run": "B", "speedup": "1.010", "95% CI": ci,
         "verdict": "inconclusive", "to settle": f"~{n} pairs (vpipe ab --pairs {n})"}
        for s, ci, n in (("zbv", "0.97-1.05", 12), ("1f1b", "0.90-1.12", 40))
    ]  # fmt: skip
    line = ab_headline(pd.DataFrame(rows), "A")
    assert line.endswith(
        "to settle: ~12 pairs (vpipe ab --pairs 12) for zbv M=8 vpipe, ~40 pairs (vpipe ab "
        "--pairs 40) for 1f1b M=8 vpipe"
    ), line


def test_an_old_version_is_known_by_its_flags_and_its_store_read_as_a_block(tmp_path):
    old = tmp_path / "old"
    (old / "vpipe" / "commands").mkdir(parents=True)
    (old / "vpipe" / "commands" / "bench.py").write_text('p.add_argument("--rounds")\n')
    new = _version("B", "HEAD", ROOT)
    assert knows_flag(ROOT, "--paced") and not knows_flag(old, "--paced")
    assert method({"A": _version("A", "HEAD", ROOT), "B": new}) == ""
    words = method({"A": _version("A", "v1", old), "B": new})
    assert words.startswith("whole launches in turn: A = v1 has no vpipe bench --paced")
    store = tmp_path / "store"
    store.mkdir()
    steps = pd.DataFrame(
        [dict(schedule="zbv", microbatches=4, impl="vpipe", round=r, step=s,
              step_time_s=0.1 + r / 100 + s / 1000, ref_s=0.01) for r in (1, 0) for s in (1, 0)]
    )  # fmt: skip
    steps.to_parquet(store / "steps.parquet")
    (store / "meta.json").write_text(json.dumps({"reference": {"rows": 64}}))
    m = store_message(store, 0, 12.5)
    assert m["configs"] == [["zbv", 4, "vpipe"]] and m["reference"] == {"rows": 64}
    assert m["steps"] == [[0.1, 0.101, 0.11, 0.111]] and m["refs"] == [[0.01] * 4]
    assert m["host"] == [] and m["wall_s"] == 12.5


def test_vpipe_ab_answers_against_a_commit_from_before_it_existed(tmp_path):
    """A real commit of this repository from before vpipe ab (its vpipe bench has no --paced)
    against this checkout: both sides run as whole launches in turn, and the session says so."""
    out = tmp_path / "session"
    cmd = [sys.executable, "-m", "vpipe", "ab", OLD, str(ROOT), "--schedules", "1f1b",
           "--impl", "vpipe", "--microbatches", "2", "--batch", "8", "--sizes",
           "d_model=32,d_hidden=64", "--rounds", "2", "--steps", "2", "--warmup", "1",
           "--pairs", "2", "--out", str(out), "--cache", str(tmp_path / "cache")]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"whole launches in turn: A = {OLD} has no vpipe bench --paced" in res.stdout
    record = json.loads((out / "session.json").read_text())
    assert [x["side"] for x in record["launches"]] == ["A", "B", "B", "A"]
    assert all(len(x["steps"]) == 1 and len(x["steps"][0]) == 4 for x in record["launches"])
    assert record["ready"]["A"]["configs"] == [["1f1b", 2, "vpipe"]] == record["ready"]["B"]["configs"]
    md = (out / "report.md").read_text()
    assert "| 1f1b | 2 | vpipe |" in md and f"; whole launches in turn: A = {OLD} has no" in md
    for side in "AB":
        assert sorted(p.name for p in (out / side).glob("launch-*")) == ["launch-1", "launch-2"]
    assert "A: 2 launches in " in res.stdout and "pair 2/2 done" in res.stdout
