"""One side of a ``vpipe ab`` session as whole launches: each block is one ``vpipe bench`` run
of the version's own command, its figures read back from the store it writes.

A version from before ``vpipe bench --paced`` (:mod:`vpipe.sweep.paced`) cannot be asked for
one block at a time, so its launches are whole commands, as asv times each commit's installed
code: every launch starts an interpreter, imports torch and spawns the ranks, and only its
timed steps count. Launches of the two versions then alternate A B B A ... as paced blocks do,
but each pair's launches are a command apart (seconds more than paced blocks, far more than
gated rounds), so the host's drift between them widens the intervals; ``vpipe ab`` says when a
session ran this way (:func:`method`). A side offers what :class:`vpipe.sweep.ab.SideProcess`
offers the session (ready, block, interrupt, finish, kill), so the session's loop is the same.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from vpipe.errors import VpipeError
from vpipe.sweep.envs import Version

PACED = "--paced"
# the flags that keep a launch's rounds as asked, where the version knows them: without them
# a launch of a newer version adds rounds until its time budget (minutes) runs out
FIXED_ROUNDS = ("--max-minutes", "0")


class LaunchError(VpipeError, RuntimeError):
    """A launch that failed: the side and its command's last line."""


def knows_flag(checkout: Path, flag: str) -> bool:
    """Whether a checkout's ``vpipe`` commands define ``flag`` (read from its source, so that
    no interpreter starts to ask)."""
    pattern = re.compile(rf"""["']{re.escape(flag)}["']""")
    files = (checkout / "vpipe" / "commands").glob("*.py")
    return any(pattern.search(p.read_text(encoding="utf-8", errors="replace")) for p in files)


def method(versions: dict[str, Version]) -> str:
    """How a session runs its sides, in words: paced blocks, or whole launches where a version
    cannot pace (named)."""
    old = [v for v in versions.values() if not knows_flag(v.checkout, PACED)]
    if not old:
        return ""
    who = " and ".join(f"{v.label} = {v.name}" for v in old)
    return (
        f"whole launches in turn: {who} has no vpipe bench {PACED}, so every launch of both "
        "sides is a whole vpipe bench command (its interpreter, torch and ranks started anew; "
        "only its timed steps count), and a pair's launches are a command apart: wider "
        "intervals than paced sessions"
    )


def store_message(store: Path, index: int, wall_s: float) -> dict[str, Any]:
    """A launch's block message (as :func:`vpipe.sweep.paced.block_message`'s, with its
    configs and reference shape) read from the store its ``vpipe bench`` wrote: per config in
    the order of its first step, the timed steps and reference times, and the host's rounds."""
    import pandas as pd

    steps = pd.read_parquet(store / "steps.parquet")
    keys = ["schedule", "microbatches", "impl"]
    configs = [list(k) for k in steps[keys].drop_duplicates().itertuples(index=False)]
    times, refs = [], []
    for s, m, i in configs:
        d = steps[(steps["schedule"] == s) & (steps["microbatches"] == m) & (steps["impl"] == i)]
        d = d.sort_values(["round", "step"])
        times.append([float(t) for t in d["step_time_s"]])
        known = "ref_s" in d and d["ref_s"].notna().all()
        refs.append([float(r) for r in d["ref_s"]] if known else None)
    host_path = store / "host.parquet"
    host = pd.read_parquet(host_path).to_dict("records") if host_path.exists() else []
    meta_path = store / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    return {
        "block": index,
        "wall_s": round(wall_s, 3),
        "steps": times,
        "refs": refs if any(r is not None for r in refs) else None,
        "host": host,
        "configs": [[str(s), int(m), str(i)] for s, m, i in configs],
        "reference": meta.get("reference"),
    }


class LaunchedSide:
    """One version whose blocks are whole ``vpipe bench`` commands (see the module's doc),
    each writing its store under ``out/launch-N``."""

    def __init__(self, version: Version, bench_args: list[str], out: Path, log_path: Path):
        self.version = version
        self.out = out
        self.log_path = log_path
        fixed = list(FIXED_ROUNDS) if knows_flag(version.checkout, FIXED_ROUNDS[0]) else []
        self.args = [*bench_args, *fixed, "--no-profile"]
        self.proc: subprocess.Popen[str] | None = None
        self.done = 0
        self.busy = False
        log_path.write_text("")

    def expect(self, key: str, timeout_s: float) -> dict[str, Any]:
        """The side's ``ready`` (configs come with its first block: :func:`store_message`)."""
        assert key == "ready"
        return {"launched": True}

    def block(self) -> dict[str, Any]:
        """One whole launch; its block message."""
        store = self.out / f"launch-{self.done + 1}"
        cmd = [str(self.version.python), "-m", "vpipe", "bench", *self.args, "--out", str(store)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        t0 = time.monotonic()
        self.busy = True
        with self.log_path.open("a", encoding="utf-8") as log:
            log.write(" ".join(cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(
                cmd, cwd=self.version.checkout, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )  # fmt: skip
            code = self.proc.wait()
        self.busy = False
        if code:
            raise LaunchError(f"{self.version.describe}: a launch {self._why(code)}")
        self.done += 1
        return store_message(store, self.done - 1, time.monotonic() - t0)

    def _why(self, code: int) -> str:
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return f"exited with status {code}: {lines[-1].strip()}" if lines else f"exited with status {code}"

    def interrupt(self) -> None:
        """Stop the launch in progress (its store is not read)."""
        if self.busy and self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)

    def end(self) -> None:
        """Nothing to ask: every finished launch has written its store."""

    def finish(self) -> str:
        n = self.done
        return f"{self.version.label}: {n} launch{'es' * (n != 1)} in {self.out}/launch-*"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
