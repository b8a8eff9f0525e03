"""Quiet runs compared with the next (``vpipe report A B`` on two back-to-back runs): how often
the host reads as differed, and how far the host-speed reference moves between quiet runs.

    python -m bench.back_to_back [--pairs 10] [--sweep "vpipe bench options"]

Runs ``2 x --pairs`` plain ``vpipe bench`` sweeps of the workload one after the other (each
as a user runs it, profiling included), and compares each odd run with the next as
``vpipe report`` does. Prints each comparison's verdicts, the two runs' reference medians and
host state, and what made a host "differ"; then how many comparisons read "host differed",
the reference's spread between runs (log sd of all runs' medians, which includes the host's
drift over the session, and one run's sd from the back-to-back pairs: the figure
:data:`vpipe.trace.host_state.REF_RUN_SD` stands for) and the host's load.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The held-out A/A workload: an MLP of two small layers, two schedules, one implementation
SWEEP = "--impl vpipe --schedules 1f1b,zbv --microbatches 8 --sizes d_model=256,d_hidden=1024 --batch 256"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--sweep", default=SWEEP)
    args = p.parse_args(argv)
    from vpipe.report.comparison import comparison_table, load_sweeps
    from vpipe.report.crossrun_table import host_summary

    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    differed, refs = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            outs = [Path(tmp) / f"run{2 * i + k}" for k in (0, 1)]
            for out in outs:
                cmd = [sys.executable, "-m", "vpipe", "bench", *shlex.split(args.sweep),
                       "--out", str(out)]  # fmt: skip
                subprocess.run(cmd, check=True, capture_output=True)
            sweeps = load_sweeps(outs)
            table = comparison_table(sweeps)
            hosts = [host_summary(s.host, s.steps) for s in sweeps]
            refs += [h["ref_s"] for h in hosts]
            words = list(table["verdict"])
            differed += "host differed" in words
            why = "; ".join(sorted({h for h in table["host"] if h}))
            print(
                f"pair {i + 1:2d}: {', '.join(words)}; reference "
                f"{hosts[0]['ref_s'] * 1e3:.3f} vs {hosts[1]['ref_s'] * 1e3:.3f} ms; other cores "
                f"{hosts[0]['other_cores']:.2f} vs {hosts[1]['other_cores']:.2f}"
                + (f"; {why}" if why else "")
                + f"; load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    logs = [math.log(r) for r in refs]
    steps = [abs(b - a) for a, b in zip(logs[::2], logs[1::2], strict=True)]
    # what REF_RUN_SD stands for: one run's sd as seen by a comparison with the next run
    # (RMS of the pairs' log differences over sqrt 2), free of the drift across the session
    pair_sd = math.sqrt(statistics.fmean(d * d for d in steps) / 2)
    robust_sd = statistics.median(steps) / 0.6745 / math.sqrt(2)  # the same, from the median pair
    print(
        f"host differed in {differed} of {args.pairs} back-to-back comparisons; reference "
        f"between runs: sd {statistics.stdev(logs):.3f} (log) over {len(logs)} runs, "
        f"{pair_sd:.3f} per run from the back-to-back pairs ({robust_sd:.3f} from their median), "
        f"back-to-back ratio median {math.expm1(statistics.median(steps)):.1%}, max "
        f"{math.expm1(max(steps)):.1%}; host load (1 min) at start {load0:.2f}, at end "
        f"{os.getloadavg()[0]:.2f}; wall time {time.perf_counter() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
