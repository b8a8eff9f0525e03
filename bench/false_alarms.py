"""False alarms and detections of cross-run comparisons (``vpipe report A B``'s rules).

    python -m bench.false_alarms [--aa 20] [--delayed 10] [--blocks 5] [--delay-pct 15]
    python -m bench.false_alarms --ab [...]   # vpipe ab sessions: bench/false_alarms_ab.py

Runs a compute-bound sweep (two schedules, vpipe's runtime, an MLP whose actions take
milliseconds) many times, each run being ``--blocks`` independent launches, interleaved so
that slow drift of the host hits every kind:

- **A/A busy**: the same code twice, once quiet and once with a CPU hog (a busy loop pinned
  to one core, started by this script and stopped after the run). Any "faster"/"slower"
  verdict is a false alarm.
- **A/A quiet**: each quiet run against the next quiet run (no extra launches): the test of
  the interval itself, since the host judgement cannot step in.
- **A/A'**: quiet against quiet with a delay injected per step on rank 0
  (``--inject-delay-ms``), ``--delay-pct`` of the slowest config's quiet median step time, so
  every config is slowed by at least that much. Each config reported "slower" is a detection.

Prints every comparison's verdicts, the false-alarm rates (comparisons with any faster/slower
verdict, and configs), the detection rate, the quiet launches' spread (in total, and the
launch-to-launch part beyond the steps' sampling noise: the figure behind
:data:`vpipe.report.crossrun.LAUNCH_SD`), the host's load and the wall time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any

SCHEDULES = ("1f1b", "zbv")
# Compute per action well above the runtime's per-action overhead (about 5-10 ms of matmuls per
# action on one core; steps of about 70 ms), as the comparisons users make are: an
# overhead-bound toy (MLP 256/1024) measures thread wake-ups, its steps spread 15-25% (log sd)
# against 6-8% here, and a 9-step block cannot resolve 15%.
SIZES = {"d_model": 512, "d_hidden": 2048}
BATCH, MICROBATCHES = 128, 4
WARMUP, STEPS, ROUNDS = 2, 4, 5  # 20 timed steps per config per launch


def spec(blocks: int, delay_ms: float = 0.0) -> Any:
    from vpipe.sweep.driver import SweepSpec

    return SweepSpec(
        ranks=2,
        model="mlp",
        sizes=SIZES,
        batch=BATCH,
        schedules=SCHEDULES,
        microbatches=(MICROBATCHES,),
        impls=("vpipe",),
        warmup=WARMUP,
        steps=STEPS,
        rounds=ROUNDS,
        profile=False,
        progress=False,
        blocks=blocks,
        inject_delay_ms=delay_ms,
    )


def sweep(label: str, blocks: int, delay_ms: float = 0.0) -> Any:
    """One run (``blocks`` launches) as a :class:`vpipe.report.comparison.Sweep`, kept in memory."""
    from vpipe.report.comparison import Sweep
    from vpipe.sweep.blocks import run_blocks
    from vpipe.sweep.driver import new_run_id
    from vpipe.sweep.results import collect

    s = spec(blocks, delay_ms)
    bench_id = new_run_id()
    res = collect(s, run_blocks(s, bench_id), bench_id, 0.0, simulate=False)
    return Sweep(label, res.measured, res.steps, res.host, res.meta)


class Hog:
    """A busy loop in a child process pinned to core 0, for as long as the block lasts."""

    def __enter__(self) -> Hog:
        code = "import os\nif hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, {0})\nwhile True: pass"
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.5)  # let it reach the loop
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def verdicts(base: Any, run: Any) -> tuple[list[str], str]:
    """The comparison's verdict per config, and a line with each verdict's ratio and interval
    and each side's host state in brief."""
    from vpipe.report.comparison import comparison_table, ratio_label
    from vpipe.report.crossrun_table import host_summary

    table = comparison_table([base, run])
    label = ratio_label([base, run])
    rows = table.to_dict("records")
    shown = [f"{row['verdict']} {row[label]} ({row['95% CI']})" for row in rows]
    for s in (base, run):
        h = host_summary(s.host, s.steps)
        shown.append(
            f"[{s.label}: other {h['other_cores'] or 0:.2f} cores, ref {(h['ref_s'] or 0) * 1e3:.2f} ms]"
        )
    return [row["verdict"] for row in rows], ", ".join(shown)


DECIDED = {"faster", "slower"}


def compare(title: str, base: Any, run: Any, into: list[list[str]]) -> None:
    """Compare two runs, keep the verdicts in ``into`` and print them with their figures."""
    words, line = verdicts(base, run)
    into.append(words)
    print(f"{title} {line}", flush=True)


def alarm_rate(rows: list[list[str]]) -> str:
    """The verdicts of A/A comparisons, and how many said faster/slower (false alarms)."""
    alarms = sum(any(v in DECIDED for v in row) for row in rows)
    configs = sum(v in DECIDED for row in rows for v in row)
    return (
        f"{dict(Counter(v for r in rows for v in r))}; false alarms {alarms}/{len(rows)} "
        f"comparisons ({alarms / max(len(rows), 1):.0%}), "
        f"{configs}/{sum(len(r) for r in rows)} configs"
    )


def detection_rate(rows: list[list[str]], pct: float) -> str:
    """The verdicts of A/A' comparisons, and how many called every config slower."""
    caught = sum(all(v == "slower" for v in row) for row in rows)
    configs = sum(v == "slower" for row in rows for v in row)
    return (
        f"{dict(Counter(v for r in rows for v in r))}; a {pct:g}% delay detected in "
        f"{caught}/{len(rows)} comparisons ({caught / max(len(rows), 1):.0%}), "
        f"{configs}/{sum(len(r) for r in rows)} configs"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--aa", type=int, default=20, help="A/A comparisons (default 20)")
    p.add_argument("--delayed", type=int, default=10, help="A/A' comparisons (default 10)")
    p.add_argument("--blocks", type=int, default=5, help="launches per run (default 5)")
    p.add_argument(
        "--delay-pct", type=float, default=None, help="injected delay, %% (default 15; --ab: 10)"
    )
    p.add_argument(
        "--ab",
        action="store_true",
        help="measure vpipe ab sessions instead (bench/false_alarms_ab.py: A/A with a hog for "
        "a random half of each session, and B slowed by --delay-pct, quiet and with the hog)",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=20,
        help="--ab: vpipe ab --pairs (default 20: the time budget, each session's --max-minutes, "
        "is what ends a session that does not settle)",
    )
    p.add_argument(
        "--fixed-delay",
        action="store_true",
        help="--ab: B's delay a fixed sleep (--inject-delay-ms-b) of --delay-pct of the fastest "
        "config's quiet step, not --delay-pct of its own step (--inject-delay-pct-b)",
    )
    p.add_argument("--sweep", default=None, help="--ab: the sessions' vpipe bench options")
    p.add_argument("--no-hog", action="store_true", help="--ab: no hog in any session")
    p.add_argument(
        "--hog-throughout",
        action="store_true",
        help="--ab: only the sessions with the hog, which runs from their first seconds to their end",
    )
    p.add_argument("--seed", type=int, default=0, help="--ab: seed of the hog's timing")
    p.add_argument("--keep", default=None, help="--ab: copy each session's session.json here")
    args = p.parse_args(argv)
    if args.ab:
        from bench import false_alarms_ab

        args.delay_pct = 10.0 if args.delay_pct is None else args.delay_pct
        args.sweep = args.sweep or false_alarms_ab.SWEEP
        return false_alarms_ab.main(args)
    args.delay_pct = 15.0 if args.delay_pct is None else args.delay_pct
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]

    calibration = sweep("calibration", 1)
    slowest = float(calibration.runs["step_time_s"].max())
    delay_ms = round(slowest * args.delay_pct / 100 * 1e3, 3)
    print(f"slowest config's median step {slowest * 1e3:.2f} ms: injected delay {delay_ms} ms")

    from vpipe.report.crossrun import between_block_sd, launch_spread, run_drift
    from vpipe.report.crossrun_table import all_blocks

    aa: list[list[str]] = []
    aa_quiet: list[list[str]] = []
    delayed: list[list[str]] = []
    quiet_runs = []
    for i in range(max(args.aa, args.delayed)):
        quiet = sweep(f"quiet{i}", args.blocks)
        quiet_runs.append(quiet)
        if i > 0:
            compare(f"A/A  {i:2d} quiet vs quiet: ", quiet_runs[-2], quiet, aa_quiet)
        if i < args.aa:
            with Hog():
                busy = sweep(f"busy{i}", args.blocks)
            compare(f"A/A  {i + 1:2d} quiet vs busy:  ", quiet, busy, aa)
        if i < args.delayed:
            slow = sweep(f"delayed{i}", args.blocks, delay_ms)
            compare(f"A/A' {i + 1:2d} quiet vs delayed:", quiet, slow, delayed)

    wall = time.perf_counter() - t0
    print()
    for name, rows in (("A/A busy", aa), ("A/A quiet", aa_quiet)):
        print(f"{name}: {alarm_rate(rows)}")
    print(f"A/A': {detection_rate(delayed, args.delay_pct)}")
    configs = [c for s in quiet_runs for c in all_blocks(s.steps)]
    for normalise, name in ((True, "normalised"), (False, "raw")):
        total, launch = between_block_sd(configs, normalise), launch_spread(configs, normalise)
        if total is None or launch is None:
            print("run-to-run spread: needs --blocks >= 2")
            break
        drift = run_drift([all_blocks(s.steps) for s in quiet_runs], normalise)
        print(
            f"quiet launches, {name}: sd between blocks {total:.3f} (log), of which "
            f"launch-to-launch {launch[0]:.3f} ({launch[1]} dof) beyond the steps' sampling "
            f"noise; drift of whole runs beyond their blocks' spread {drift or 0:.3f}"
        )
    print(
        f"host load (1 min) at start {load0:.2f}, at end {os.getloadavg()[0]:.2f}; "
        f"{os.cpu_count()} CPUs; wall time {wall:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
