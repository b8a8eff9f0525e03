"""How long ``vpipe analyze`` takes on a directory of CPU traces that hold every operator (as
torch.profiler records by default): 4 ranks of torch's ZBVZeroBubble (bench.torch_traces),
about ``--mb`` MB in all. Prints the directory's size and events, then the wall time of
``vpipe analyze DIR`` as a command (interpreter start and imports included) and of the
conversion alone, the median of ``--reps`` runs each.

Run: ``python -m bench.analyze_speed [--dir DIR] [--mb 40] [--reps 3]`` (``--dir``: an existing
trace directory, else one is recorded).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def _record(out: Path, mb: float) -> Path:
    from bench.torch_traces import record

    # one profiled step of this job writes about 4.4 MB over the 4 ranks
    record(out, 4, ["ZBVZeroBubble"], microbatches=8, blocks=2, active=max(1, round(mb / 4.4)))
    return out / "ZBVZeroBubble"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="a trace directory (default: record one)")
    ap.add_argument("--mb", type=float, default=40.0, help="size of the recorded directory")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(a.dir) if a.dir else _record(Path(tmp), a.mb)
        size = sum(p.stat().st_size for p in d.iterdir()) / 1e6
        from vpipe.trace.kineto import convert

        conv, cli = [], []
        for _ in range(a.reps):
            t = time.perf_counter()
            tr = convert([d])
            conv.append(time.perf_counter() - t)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "vpipe", "analyze", str(d)], check=True,
                           capture_output=True)  # fmt: skip
            cli.append(time.perf_counter() - t)
        print(f"{d}: {size:.1f} MB, {tr.n_trace_events:,} trace events, {len(tr.events)} rows")
        print(f"vpipe analyze: {statistics.median(cli):.2f} s median of {a.reps} "
              f"(conversion alone {statistics.median(conv):.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
