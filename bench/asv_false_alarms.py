"""False alarms and detections of ``asv continuous`` on this suite.

    python -m bench.asv_false_alarms [--tries 3] [--delay-pct 15] [--schedules 1f1b,zbv]
                                     [--microbatches 4] [--busy] [--no-slowdown]

In a scratch clone of this checkout's HEAD it makes two commits on top: one that changes only
the README (benchmarked code identical: any "PERFORMANCE DECREASED" or "INCREASED" is a false
alarm), and one that makes every pipeline step sleep ``--delay-pct`` of its previous step (a sleep added to
the harness's training step on every rank: a real slowdown, which asv must report). It then runs
``asv continuous --interleave-rounds -a rounds=7`` (asv's own virtualenv, default factor 1.1; the suite's
rounds alternate the two commits) ``--tries`` times on the identical pair and once on the
slowed pair, and prints each verdict and the wall time. ``--busy`` keeps one core busy (a
pinned busy loop) while the second commit's rounds are benchmarked, so the identical pair is
also compared across a busy and a quiet host. The pipeline grid is narrowed
by ``--schedules`` and ``--microbatches`` (VPIPE_ASV_SCHEDULES / VPIPE_ASV_MICROBATCHES).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = "vpipe/sweep/harness.py"
# the slowed commit sleeps in every rank's training step, just after this line (a change to the
# benchmarked code; a changed default of RankSpec.inject_delay_s would not do: the sweep passes
# its own --inject-delay-ms explicitly)
STEP_LINE = "        self.zero_grad()\n"
ROUNDS = 7  # benchmarks.benchmarks.ROUNDS: the suite's rounds, given on asv's command line
HOG = "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"  # one core kept busy


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def commit(repo: Path, message: str) -> str:
    git(
        repo,
        "-c",
        "user.name=vpipe-bench",
        "-c",
        "user.email=bench@vpipe",
        "commit",
        "-qam",
        message,
    )
    return git(repo, "rev-parse", "HEAD")


def make_commits(repo: Path, share: float) -> tuple[str, str, str]:
    """(base, identical code, slowed code) commits in ``repo``."""
    base = git(repo, "rev-parse", "HEAD")
    readme = repo / "README.md"
    readme.write_text(readme.read_text() + "\n<!-- a change outside the benchmarked code -->\n")
    same = commit(repo, "README only")
    git(repo, "checkout", "-q", base)
    harness = repo / HARNESS
    text = harness.read_text()
    if text.count(STEP_LINE) != 1:
        raise SystemExit(f"{HARNESS} has no single line {STEP_LINE.strip()!r} to slow steps after")
    # a share of the step, not a fixed sleep: the step's length varies with the host's day
    # (a 10 ms sleep was 15% of a 70 ms step on 2026-12-04 and 8-11% of the steps of
    # 2026-12-06, under asv's 10% factor)
    sleep = f"        time.sleep({share:g} * self.last_step_s)\n"
    harness.write_text(text.replace(STEP_LINE, STEP_LINE + sleep))
    slow = commit(repo, f"every step {share:.0%} slower")
    return base, same, slow


def asv_config(repo: Path, work: Path) -> Path:
    """A copy of ``repo``'s asv.conf.json in ``work`` that benchmarks ``repo`` and keeps its
    results, HTML and environments under ``work`` (nothing of the checkout is touched)."""
    conf = json.loads((repo / "asv.conf.json").read_text())
    conf.update(
        repo=str(repo),
        benchmark_dir=str(repo / "benchmarks"),
        results_dir=str(work / "results"),
        html_dir=str(work / "html"),
        env_dir=str(work / "env"),
    )
    path = work / "asv.conf.json"
    path.write_text(json.dumps(conf))
    return path


def continuous(
    conf: Path, work: Path, a: str, b: str, env: dict[str, str], busy: bool
) -> tuple[str, list[str]]:
    """asv continuous a b; its verdict line(s) ("PERFORMANCE DECREASED", ...) and changes."""
    cmd = [sys.executable, "-m", "asv", "continuous", "--interleave-rounds", "-a",
           f"rounds={ROUNDS}", "--config", str(conf), "--machine", "vpipe-aa", "--show-stderr",
           a, b]  # fmt: skip
    if busy:  # the busy loop runs while asv benchmarks commit b (asv names each commit)
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, text=True,
                                stderr=subprocess.STDOUT)  # fmt: skip
        assert proc.stdout is not None
        lines: list[str] = []
        hog = None
        for line in proc.stdout:
            lines.append(line)
            if "commit" in line and b[:8] in line and hog is None:
                hog = subprocess.Popen([sys.executable, "-c", HOG])
            elif "commit" in line and a[:8] in line and hog is not None:
                hog.terminate()
                hog.wait()
                hog = None
        proc.wait()
        if hog is not None:
            hog.terminate()
            hog.wait()
        out = "".join(lines)
    else:
        out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True).stdout
    # asv's table rows of changed benchmarks: "| + | before | after | ratio | name |", "!" where
    # the second commit gave no figure (asv counts that as worse: "introduced a failure")
    changes = [ln.strip() for ln in out.splitlines() if re.match(r"\s*\|?\s*[+!-]\s*\|", ln)]
    words = [w for w in ("PERFORMANCE DECREASED", "PERFORMANCE INCREASED") if w in out]
    skipped = out.count("no sample this round")  # a sweep on a busy host gives no sample
    if skipped:
        words.append(f"{skipped} benchmark readings without a sample (busy host)")
    # a crash or a timeout (asv shows its stderr); not the "failed" of a round without a sample
    if "Traceback" in out or "timed out" in out:
        words.append("BENCHMARK FAILED")
    return " and ".join(words) or "no change", changes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tries", type=int, default=3, help="A/A runs of asv continuous (default 3)")
    p.add_argument(
        "--delay-pct",
        type=float,
        default=15.0,
        help="slowdown: every step sleeps this share of the previous step (default 15)",
    )
    p.add_argument("--schedules", default="1f1b,zbv")
    p.add_argument("--microbatches", default="4")
    p.add_argument("--busy", action="store_true", help="a busy core while the 2nd commit runs")
    p.add_argument("--no-slowdown", action="store_true", help="skip the slowed pair")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "repo"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
        base, same, slow = make_commits(repo, args.delay_pct / 100)
        conf = asv_config(repo, work)
        (work / "home").mkdir()
        env = {**os.environ, "HOME": str(work / "home"), "VPIPE_ASV_SCHEDULES": args.schedules,
               "VPIPE_ASV_MICROBATCHES": args.microbatches}  # fmt: skip
        subprocess.run([sys.executable, "-m", "asv", "machine", "--yes", "--machine", "vpipe-aa",
                        "--config", str(conf)], cwd=work, env=env, capture_output=True, check=True)  # fmt: skip
        alarms = ratios = 0
        for i in range(args.tries):
            word, changes = continuous(conf, work, base, same, env, args.busy)
            alarms += "PERFORMANCE" in word
            ratios += any(not c.lstrip("| ").startswith("!") for c in changes)
            print(f"A/A  try {i + 1}: {word}", *(f"    {c}" for c in changes), sep="\n", flush=True)
        slowed = "not run"
        if not args.no_slowdown:
            word, changes = continuous(conf, work, base, slow, env, False)
            print(f"A/A' ({args.delay_pct:g}% of each step): {word}",
                  *(f"    {c}" for c in changes), sep="\n")  # fmt: skip
            slowed = "yes" if "DECREASED" in word else "no"
    print(f"false alarms: {alarms}/{args.tries} ({ratios} with a changed figure, the rest a "
          f"benchmark without a figure); slowdown reported: {slowed}; "
          f"wall time {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
