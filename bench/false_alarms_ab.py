"""False alarms and detections of ``vpipe ab`` (``python -m bench.false_alarms --ab``).

    python -m bench.false_alarms --ab [--aa 20] [--delayed 10] [--delay-pct 10] [--pairs 20]
                                      [--sweep "--impl vpipe ..."] [--no-hog] [--fixed-delay]
                                      [--hog-throughout] [--keep DIR]

In a scratch clone of this checkout's HEAD (so the session's worktrees and environments are
the clone's), it times two plain ``vpipe bench`` sweeps of the workload with fixed rounds
(``--max-minutes 0``; the time budget of a session: twice theirs, given to every session as
its ``--max-minutes``), then runs ``vpipe ab HEAD HEAD`` sessions, the quiet ones first:

- **A/A'** (``--delayed``, each quiet and with the hog): B slowed by ``--delay-pct`` of its
  step (``--inject-delay-pct-b``: a sleep of that share of its previous step, so B stays that
  much slower under the hog, as it would with extra work); with ``--fixed-delay``, a fixed
  sleep of that share of the fastest config's quiet median step (``--inject-delay-ms-b``; a
  smaller share of a step the hog slows). A session whose verdict over all configs is
  "slower" detects it (also counted: sessions that call every config "slower").
- **A/A with a hog** (``--aa``): the same commit on both sides; a busy loop pinned to one core
  starts at a random point of the session (between 5% and 50% of its expected length, never at
  its start) and runs for half of it. The expected length is the median wall time of the
  sessions of the same kind so far (the time budget before the first), so the hog lands
  inside the session. ``--hog-throughout``: only the sessions with the hog, which then starts
  1-4 s into each (before its first pair ends) and runs to its end. Any
  "faster"/"slower" verdict, over all configs or of one, is a false alarm.

Prints every session's verdicts with ratio and interval, pairs used and left out, wall time
against the budget and the host's load; then the false-alarm and detection counts, the
sessions' times, and the pairs' spread beyond their sampling noise pooled over the quiet
pairs (the adjacent-launch spread that :data:`vpipe.report.crossrun.LAUNCH_SD` bounds).
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The workload: compute-bound actions of milliseconds (bench.false_alarms' sizes), two schedules
SWEEP = "--impl vpipe --schedules 1f1b,zbv --microbatches 4 --sizes d_model=512,d_hidden=2048 --batch 128"
HOG = (
    "import os\nif hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, {0})\nwhile True: pass"
)


def vpipe_command() -> list[str]:
    """This checkout's vpipe (the console script beside this interpreter, so that the clone's
    own package on the current directory is not imported instead)."""
    script = Path(sys.executable).parent / "vpipe"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vpipe"]


def plain_sweep(repo: Path, sweep: str, out: Path) -> tuple[float, float]:
    """Wall seconds of one plain ``vpipe bench`` of the workload, and its fastest config's
    median step (s)."""
    t0 = time.perf_counter()
    cmd = [*vpipe_command(), "bench", *shlex.split(sweep), "--max-minutes", "0", "--out",
           str(out), "--force"]  # fmt: skip
    subprocess.run(cmd, cwd=repo, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    import pandas as pd

    steps = pd.read_parquet(out / "steps.parquet")
    fastest = float(steps.groupby(["schedule", "microbatches"])["step_time_s"].median().min())
    return wall, fastest


class TimedHog:
    """A busy loop pinned to core 0 from ``start_s`` after entering for ``length_s`` (or until
    the session ends), in a thread that starts and stops the process."""

    def __init__(self, start_s: float, length_s: float) -> None:
        self.start_s, self.length_s = start_s, length_s
        self.stop = threading.Event()
        self.ran_s = 0.0

    def _run(self) -> None:
        if self.stop.wait(self.start_s):
            return
        proc = subprocess.Popen([sys.executable, "-c", HOG])
        t0 = time.monotonic()
        self.stop.wait(self.length_s)
        proc.terminate()
        proc.wait(timeout=10)
        self.ran_s = time.monotonic() - t0

    def __enter__(self) -> TimedHog:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def session(
    repo: Path, out: Path, sweep: str, pairs: int, minutes: float, delay: list[str],
    hog: TimedHog | None,
) -> dict[str, Any]:  # fmt: skip
    """One ``vpipe ab HEAD HEAD`` session (``delay``: B's injected delay option and value, or
    none); its table rows, wall time and session record."""
    cmd = [*vpipe_command(), "ab", "HEAD", "HEAD", *shlex.split(sweep), "--out", str(out),
           "--pairs", str(pairs), "--max-minutes", f"{minutes:.4f}", *delay]  # fmt: skip
    t0 = time.perf_counter()
    if hog is None:
        done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    else:
        with hog:
            done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"vpipe ab failed: {done.stderr.strip().splitlines()[-1:]}")
    record = json.loads((out / "session.json").read_text())
    from vpipe.report.ab_report import session_table
    from vpipe.report.looks import report_alpha

    labels = {"A": "A", "B": "B"}
    launches = [(x["side"], x) for x in record["launches"]]
    alpha = report_alpha(record["looks"])
    table, _, _ = session_table(record["ready"], launches, alpha=alpha, labels=labels)
    return {"rows": table.to_dict("records"), "wall": wall, "record": record}


def describe(kind: str, i: int, result: dict[str, Any], budget: float, hog: TimedHog | None) -> str:
    rows = result["rows"]
    cells = ", ".join(
        f"{r['schedule']} {r['verdict']} {r['speedup']} ({r['95% CI']}) {r['pairs']}+{r['left out']}p"
        for r in rows
    )
    hogged = (
        f", hog {hog.start_s:.0f}-{hog.start_s + hog.length_s:.0f} s ran {hog.ran_s:.0f} s"
        if hog
        else ""
    )
    return (
        f"{kind} {i:2d}: {cells}; {result['record']['stopped']}; wall {result['wall']:.0f} s "
        f"({result['wall'] / budget:.2f}x the budget){hogged}; load {os.getloadavg()[0]:.2f}"
    )


def pooled_spread(results: list[dict[str, Any]]) -> tuple[float, int] | None:
    """The pairs' spread beyond sampling noise (sd of a pair's log difference), pooled over
    every config of the given sessions' pairs that saw the same host."""
    from vpipe.report.ab_report import session_figure, session_pairs
    from vpipe.report.pairs import differences, pair_spread

    configs, fitted = [], 0
    for res in results:
        rec = res["record"]
        pairs = session_pairs(rec["ready"], [(x["side"], x) for x in rec["launches"]])
        figure, _ = session_figure(rec["ready"], pairs)
        fitted += figure.fitted
        for ps in pairs.values():
            kept = [p for p in ps if not p.host_differences]
            configs.append(differences(kept, figure.weight))
    return pair_spread(configs, fitted)


def overall_z(record: dict[str, Any]) -> float | None:
    """An A/A session's log(A/B) over all configs in its standard errors (the half-width of a
    68% interval) at its end: over many sessions their sd is 1 unless each side carries an
    effect of its own that stays the whole session (its fork server's, say), which the pairs
    cannot see; None without an interval."""
    import math
    from statistics import NormalDist

    from vpipe.report.ab_report import session_figure, session_pairs
    from vpipe.report.pairs import overall_ratio

    pairs = session_pairs(record["ready"], [(x["side"], x) for x in record["launches"]])
    figure, spread = session_figure(record["ready"], pairs)
    r = overall_ratio(list(pairs.values()), figure, spread, 2 * NormalDist().cdf(1) - 1)
    if not r.has_interval or r.high <= r.value:
        return None
    return math.log(r.value) / math.log(r.high / r.value)


def main(args: Any) -> int:
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "repo"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
        from vpipe.sweep.envs import CACHE, prepare

        prepare("A", "HEAD", repo, repo / CACHE)  # made now, so no session's time includes it
        plain = [plain_sweep(repo, args.sweep, work / f"plain{i}") for i in (0, 1)]
        walls, fastest = [w for w, _ in plain], [f for _, f in plain]
        budget = sum(walls)
        if args.fixed_delay:
            delay_ms = round(min(fastest) * args.delay_pct / 100 * 1e3, 3)
            delay = ["--inject-delay-ms-b", f"{delay_ms:g}"]
            what = f"{delay_ms} ms ({args.delay_pct:g}% of the fastest config's step)"
        else:
            delay = ["--inject-delay-pct-b", f"{args.delay_pct:g}"]
            what = f"{args.delay_pct:g}% of its step"
        print(f"two plain sweeps {walls[0]:.1f} + {walls[1]:.1f} s: budget {2 * budget:.0f} s "
              f"a session (its --max-minutes); fastest config's step {min(fastest) * 1e3:.2f} "
              f"ms; B's delay {what}", flush=True)  # fmt: skip

        walls_so_far: list[float] = []

        def hog(kind: str) -> TimedHog | None:
            if args.no_hog:
                return None
            if args.hog_throughout:  # on before the first pair ends; twice a budget: to the end
                return TimedHog(rng.uniform(1.0, 4.0), 4 * budget)
            # the expected session: the median of this kind's so far (before any, the budget;
            # quiet sessions that settle early say nothing of how long one under a hog lasts)
            walls = sorted(r["wall"] for r in kinds[kind])
            expected = walls[len(walls) // 2] if walls else 2 * budget
            return TimedHog(rng.uniform(0.05, 0.5) * expected, expected / 2)

        aa = "A/A quiet" if args.no_hog else "A/A hog"
        kinds: dict[str, list[dict[str, Any]]] = {aa: [], "A/A' quiet": [], "A/A' hog": []}
        delayed = ("A/A' quiet",) if args.no_hog else ("A/A' quiet", "A/A' hog")
        # quiet first; with the hog throughout, only the sessions under it
        plan = [] if args.hog_throughout else [(delayed[0], i, delay) for i in range(args.delayed)]
        plan += [(aa, i, []) for i in range(args.aa)]
        plan += [(k, i, delay) for i in range(args.delayed) for k in delayed[1:]]
        for kind, i, slow_b in plan:
            h = hog(kind) if kind.endswith("hog") else None
            out = work / f"s{len(sum(kinds.values(), []))}"
            res = session(repo, out, args.sweep, args.pairs, 2 * budget / 60, slow_b, h)
            kinds[kind].append(res)
            walls_so_far.append(res["wall"])
            print(describe(kind, i + 1, res, 2 * budget, h), flush=True)
            if args.keep:  # the session's record, to study the pairs offline
                name = f"{len(walls_so_far):02d}-{kind.replace('/', '').replace(' ', '-')}.json"
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(out / "session.json", Path(args.keep) / name)
            shutil.rmtree(out, ignore_errors=True)

    print()
    from vpipe.report.ab_report import OVERALL

    for kind, results in kinds.items():
        if not results:
            continue
        rows = [(r["schedule"] == OVERALL, r["verdict"]) for res in results for r in res["rows"]]
        words = [w for over, w in rows if not over]
        overall = [w for over, w in rows if over]
        decided = sum(w in ("faster", "slower") for w in words)
        caught = sum(
            all(r["verdict"] == "slower" for r in res["rows"] if r["schedule"] != OVERALL)
            for res in results
        )
        walls = sorted(res["wall"] / (2 * budget) for res in results)
        print(f"{kind}: configs {dict(Counter(words))}, faster/slower in {decided}/{len(words)}; "
              f"over all configs {dict(Counter(overall))}, slower in "
              f"{overall.count('slower')}/{len(overall)} sessions, faster in "
              f"{overall.count('faster')}; every config slower in {caught}/{len(results)} "
              f"sessions; session time / budget (twice two plain sweeps): median "
              f"{walls[len(walls) // 2]:.2f}x, max {walls[-1]:.2f}x")  # fmt: skip
    z = [x for res in kinds[aa] if (x := overall_z(res["record"])) is not None]
    if len(z) >= 2:
        sd = (sum(x * x for x in z) / len(z)) ** 0.5
        print(f"{aa} over all configs, log(A/B) in standard errors: sd {sd:.2f} over {len(z)} "
              f"sessions (1 expected; more: a side's own effect that lasts its session), "
              f"{' '.join(f'{x:+.1f}' for x in z)}")  # fmt: skip
    quiet = pooled_spread(kinds["A/A' quiet"] + kinds.get("A/A quiet", []))
    if quiet:
        print(f"pairs' spread beyond sampling noise (sd of log A/B, pooled): {quiet[0] ** 0.5:.4f}, "
              f"{quiet[1]} dof (per launch: {(quiet[0] / 2) ** 0.5:.4f})")  # fmt: skip
    print(f"host load (1 min) at start {load0:.2f}, at end {os.getloadavg()[0]:.2f}; "
          f"{os.cpu_count()} CPUs; wall time {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 0
