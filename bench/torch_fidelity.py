"""How well one trace of torch's own pipeline runtime predicts its other schedule classes.

Records traces as a torch user does (:mod:`bench.torch_traces`: torch.distributed.pipelining's
classes, torch.profiler with its default operator recording, no vpipe metadata), every class
running the same stages, in ``--rounds`` launches whose class order rotates, so that a change
in the host's load over the minutes of a run does not fall on one class. In each round, each
class's trace is calibrated on (:func:`vpipe.predict.calibrate.calibrate`, from what the ranks
computed), anchored to its own profiled median step, and predicts every other class's profiled
median step: the error table (rows: calibrated on; columns: predicted). Printed per round, with
how many predictions fall outside the 95% interval of the profiled ratio they are judged against
(:func:`vpipe.predict.timing_noise.outside_timing`; a trace's few profiled steps pin its median
loosely, and with fewer than six there is no interval), and the median of each cell over the
rounds.

Run: ``python -m bench.torch_fidelity OUT [--rounds 3] [--ranks 2] [--width 768] [--rows 64]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from bench.fidelity_matrix import held_out, host_line, shown
from bench.torch_traces import record
from vpipe.predict.timing_noise import outside_timing, ratio_intervals

CLASSES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def round_table(where: Path, classes: Sequence[str]) -> tuple[pd.DataFrame, dict]:
    """The error table of one round's traces (``where/<class>/``) and the intervals of the
    profiled ratios (:func:`vpipe.predict.timing_noise.ratio_intervals`)."""
    from vpipe.metrics.per_run import step_metrics
    from vpipe.predict.leave_one_out import Case, leave_one_out
    from vpipe.schedules import make_schedule
    from vpipe.trace.kineto import convert

    cases, steps = [], {}
    for name in classes:
        trace = convert([where / name])
        meta, ev = trace.meta, trace.events
        ranks, stages = int(meta["ranks"]), int(meta["stages"])
        schedule = make_schedule(str(meta["schedule"]), ranks, int(meta["microbatches"]),
                                 stages // ranks)  # fmt: skip
        steps[name] = step_metrics(ev[ev["step"] >= 0])["step_time_s"].to_numpy()
        cases.append(Case(name, schedule, ev, float(np.median(steps[name]))))
    timed = {c.label: c.timed_s for c in cases}
    return leave_one_out(cases).set_index("calibrated on"), ratio_intervals(steps, timed)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory for the traces (round<k>/<class>/)")
    ap.add_argument("--rounds", type=int, default=3, help="launches, class order rotated")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--rows", type=int, default=64, help="rows a microbatch")
    ap.add_argument("--active", type=int, default=3, help="profiled steps per class")
    args = ap.parse_args(argv)
    tables = []
    for k in range(args.rounds):
        order = list(CLASSES[k % len(CLASSES) :] + CLASSES[: k % len(CLASSES)])
        where = Path(args.out) / f"round{k}"
        print(f"round {k}: {' '.join(order)}; {host_line()}", flush=True)
        record(where, args.ranks, order, width=args.width, rows=args.rows, active=args.active)
        table, intervals = round_table(where, CLASSES)
        tables.append(table)
        cells = np.abs(held_out(table))
        print(shown(table), flush=True)
        beyond = outside_timing(table, intervals)
        judged = int(intervals["low"].notna().to_numpy().sum())
        print(f"worst |error| {cells.max() * 100:.1f}%, median {np.median(cells) * 100:.1f}%; "
              f"outside the profiled ratio's 95% interval: {len(beyond)} of {judged} cells"
              + (f", by at most {max(beyond) * 100:.1f}%" if beyond else ""))  # fmt: skip
    med = pd.concat(tables).groupby(level=0, sort=False).median().loc[tables[0].index]
    cells = np.abs(held_out(med))
    print(f"median over {args.rounds} rounds; {host_line()}")
    print(shown(med))
    print(f"worst |error| {cells.max() * 100:.1f}%, median {np.median(cells) * 100:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
