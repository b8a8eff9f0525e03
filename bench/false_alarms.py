"""False alarms and detections of cross-run comparisons (``vpipe report A B``'s rules).

    python -m bench.false_alarms [--aa 20] [--delayed 10] [--blocks 2] [--delay-pct 15]

Runs a small sweep (two schedules, vpipe's runtime, a small MLP) many times, each run being
``--blocks`` independent launches, interleaved so that slow drift of the host hits every kind:

- **A/A**: the same code twice, once quiet and once with a CPU hog (a busy loop pinned to one
  core, started by this script and stopped after the run). Any "faster"/"slower" verdict is a
  false alarm.
- **A/A'**: quiet against quiet with a delay injected per step on rank 0
  (``--inject-delay-ms``), ``--delay-pct`` of the slowest config's quiet median step time, so
  every config is slowed by at least that much. Each config reported "slower" is a detection.

Prints every comparison's verdicts, the false-alarm rate (comparisons with any faster/slower
verdict, and configs), the detection rate, the run-to-run spread of the quiet launches (the
figure behind :data:`vpipe.report.crossrun.DEFAULT_BETWEEN_SD`), the host's load and the wall time.
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
# Compute per action well above the runtime's per-action overhead (about 1-3 ms of matmuls per
# action on one core), as the comparisons users make are: an overhead-bound toy measures
# thread wake-ups, whose spread between launches is several times larger.
SIZES = {"d_model": 256, "d_hidden": 1024}
BATCH, MICROBATCHES = 128, 4


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
        warmup=1,
        steps=3,
        rounds=3,
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


def verdicts(base: Any, run: Any) -> list[str]:
    """The comparison's verdict per config, and each side's host state in brief."""
    from vpipe.report.comparison import comparison_table
    from vpipe.report.crossrun_table import host_summary

    words = list(comparison_table([base, run])["verdict"])
    for s in (base, run):
        h = host_summary(s.host, s.steps)
        words.append(
            f"[{s.label}: other {h['other_cores'] or 0:.2f} cores, ref {(h['ref_s'] or 0) * 1e3:.2f} ms]"
        )
    return words


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--aa", type=int, default=20, help="A/A comparisons (default 20)")
    p.add_argument("--delayed", type=int, default=10, help="A/A' comparisons (default 10)")
    p.add_argument("--blocks", type=int, default=2, help="launches per run (default 2)")
    p.add_argument("--delay-pct", type=float, default=15.0, help="injected delay, %% (default 15)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]

    calibration = sweep("calibration", 1)
    slowest = float(calibration.runs["step_time_s"].max())
    delay_ms = round(slowest * args.delay_pct / 100 * 1e3, 3)
    print(f"slowest config's median step {slowest * 1e3:.2f} ms: injected delay {delay_ms} ms")

    from vpipe.report.crossrun import between_block_sd
    from vpipe.report.crossrun_table import all_blocks

    aa: list[list[str]] = []
    delayed: list[list[str]] = []
    quiet_runs = []
    for i in range(max(args.aa, args.delayed)):
        quiet = sweep(f"quiet{i}", args.blocks)
        quiet_runs.append(quiet)
        if i < args.aa:
            with Hog():
                busy = sweep(f"busy{i}", args.blocks)
            aa.append(verdicts(quiet, busy))
            print(f"A/A  {i + 1:2d} quiet vs busy:   {', '.join(aa[-1])}", flush=True)
        if i < args.delayed:
            slow = sweep(f"delayed{i}", args.blocks, delay_ms)
            delayed.append(verdicts(quiet, slow))
            print(f"A/A' {i + 1:2d} quiet vs delayed: {', '.join(delayed[-1])}", flush=True)

    decided = {"faster", "slower"}
    aa = [[v for v in row if not v.startswith("[")] for row in aa]
    delayed = [[v for v in row if not v.startswith("[")] for row in delayed]
    alarms = sum(any(v in decided for v in row) for row in aa)
    alarm_configs = sum(v in decided for row in aa for v in row)
    caught = sum(all(v == "slower" for v in row) for row in delayed)
    caught_configs = sum(v == "slower" for row in delayed for v in row)
    n_aa_cfg = sum(len(r) for r in aa)
    n_d_cfg = sum(len(r) for r in delayed)
    sd = between_block_sd([c for s in quiet_runs for c in all_blocks(s.steps)], normalise=True)
    raw_sd = between_block_sd([c for s in quiet_runs for c in all_blocks(s.steps)], False)
    wall = time.perf_counter() - t0
    print()
    print(f"A/A verdicts:  {dict(Counter(v for r in aa for v in r))}")
    print(f"A/A' verdicts: {dict(Counter(v for r in delayed for v in r))}")
    print(
        f"false alarms: {alarms}/{len(aa)} comparisons ({alarms / max(len(aa), 1):.0%}), "
        f"{alarm_configs}/{n_aa_cfg} configs"
    )
    print(
        f"detection of a {args.delay_pct:g}% delay: {caught}/{len(delayed)} comparisons "
        f"({caught / max(len(delayed), 1):.0%}), {caught_configs}/{n_d_cfg} configs"
    )
    print(
        f"run-to-run sd (log) of quiet launches: normalised {sd:.3f}, raw {raw_sd:.3f}"
        if sd is not None and raw_sd is not None
        else "run-to-run sd: needs --blocks >= 2"
    )
    print(
        f"host load (1 min) at start {load0:.2f}, at end {os.getloadavg()[0]:.2f}; "
        f"{os.cpu_count()} CPUs; wall time {wall:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
