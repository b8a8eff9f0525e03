"""The simulator's fidelity matrix: calibrate on each schedule, predict every other one.

    python -m bench.fidelity_matrix [--runs 3] [--hog-runs 1] [--minutes 3] [--impl vpipe]
                                    [--profile-steps 6] [--rounds 8] [--steps 4] [--keep DIR]

Each run is one ``vpipe bench`` sweep of five schedules (P=2, M=6, an MLP of a shape no test
uses, compute-bound: actions of 7-30 ms), quiet or beside a CPU hog (a busy loop pinned to one
core, :class:`bench.false_alarms.Hog`). From its store, per implementation:

- **absolute**: calibrated on the row's profiled steps and anchored to its timed median
  (:func:`vpipe.predict.calibrate.anchor`), predicted / timed median - 1 for each column: what
  ``vpipe bench``'s fidelity table shows. The diagonal is 0 by construction.
- **relative**: without the anchor, each prediction's error relative to the calibration
  config's own: (predicted / timed) / (own predicted / own timed) - 1.
- **breakdown**: for the calibration the report's plan uses (zbv), what each term adds to each
  prediction (:func:`vpipe.predict.error_terms.breakdown`).
- **without comm threads**: the summary's worst and median absolute error again, the
  communication threads' CPU not charged (:func:`vpipe.predict.calibrate.with_comm_threads`), from the same
  sweeps.
- **timed**: how well the timed medians themselves are known: per config its timed steps and
  the 95% interval of its median, and per cell the interval of the timed ratio the prediction
  is judged against (:mod:`vpipe.predict.timing_noise`). An error inside that interval is
  one the timing cannot tell from exact; the summary counts the cells outside it. With the
  ``vpipe bench`` defaults (3 rounds of 3 steps) a config the ranking had settled got 9 timed
  steps, and its median was known to +-7-17% (95%): wider than the goal itself. ``--rounds``
  and ``--steps`` set every config's timed steps (default 8 x 4 = 32).
- **replay**: each profiled step simulated with the times its own actions took
  (:func:`vpipe.predict.step_replay.action_times`) and the calibrated posting, gaps and link,
  against that step's measured time: the error of everything but the per-action costs.

Ends with the worst held-out error of each run against the goals (relative 5%, absolute 10%).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

SCHEDULES = "1f1b,interleaved-1f1b,zb-h1,zbv,dualpipev"
SIZES = "d_model=384,d_hidden=1536,n_blocks=8"
RANKS, MICROBATCHES, BATCH = 2, 6, 384
GOAL_RELATIVE, GOAL_ABSOLUTE = 0.05, 0.10


def sweep(out: Path, minutes: float, impl: str, profile_steps: int, rounds: int,
          steps: int, extra: Sequence[str] = ()) -> float:  # fmt: skip
    """One ``vpipe bench`` launch into ``out`` (``extra``: more of its options); returns its
    wall seconds."""
    cmd = [
        sys.executable, "-m", "vpipe", "bench", "-p", str(RANKS), "-m", str(MICROBATCHES),
        "--batch", str(BATCH), "--sizes", SIZES, "--schedules", SCHEDULES, "--impl", impl,
        "--max-minutes", str(minutes), "--profile-steps", str(profile_steps),
        "--rounds", str(max(rounds, profile_steps)), "--steps", str(steps), "--out", str(out),
        "--force", *extra,
    ]  # fmt: skip
    t = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - t


def matrices(store_dir: Path, comm_threads: bool = True) -> list[dict[str, Any]]:
    """Per implementation of a stored sweep: its absolute (anchored) and relative (unanchored)
    error tables, and the breakdown of the zbv calibration (or the first one); without the
    communication threads' cost (:func:`vpipe.predict.calibrate.with_comm_threads`) unless ``comm_threads``."""
    from vpipe.predict.calibrate import anchor, calibrate, comm_thread_cpu_s, model_units
    from vpipe.predict.error_terms import breakdown
    from vpipe.predict.leave_one_out import Case, leave_one_out
    from vpipe.predict.split_cost import split_backward_ratio
    from vpipe.predict.timing_noise import sweep_intervals
    from vpipe.schedules import make_schedule
    from vpipe.trace.store import Store

    store = Store(str(store_dir))
    runs = store.runs()
    runs = runs[runs["source"].fillna("measured") == "measured"]
    meta = store.run_meta(str(runs["run_id"].iloc[0]))
    out = []
    for impl, group in runs.groupby("impl", sort=True):
        cases = []
        for r in group.itertuples():
            ev = store.events([r.run_id])
            if ev is None or not ev["kind"].astype(str).isin(["F", "B", "I", "W"]).any():
                continue
            schedule = make_schedule(r.schedule, RANKS, int(r.microbatches))
            threads = comm_thread_cpu_s(r) if comm_threads else None
            cases.append(Case(r.schedule, schedule, ev, float(r.step_time_s), threads,
                              split_backward_ratio(r)))  # fmt: skip
        if len(cases) < 2:
            continue
        units = model_units({**meta, "stages": max(c.schedule.n_stages for c in cases)})
        absolute = leave_one_out(cases, units).set_index("calibrated on")
        plain = leave_one_out(cases, units, anchored=False).set_index("calibrated on")
        own = pd.Series(np.diag(plain.loc[:, plain.index].to_numpy()), index=plain.index)
        relative = (1 + plain).div(1 + own, axis=0) - 1
        base = next((c for c in cases if c.label == "zbv"), cases[0])
        cal = anchor(calibrate(base.events, split_ratio=base.split_ratio), base.schedule,
                     base.timed_s, units,
                     comm_thread_cpu_s=base.comm_thread_cpu_s)  # fmt: skip
        terms = breakdown(cal, [(c.label, c.schedule, c.timed_s) for c in cases], units)
        out.append({
            "impl": str(impl), "absolute": absolute, "replay": replay_errors(cases),
            "timed": sweep_intervals(pd.read_parquet(store_dir / "steps.parquet"), group,
                                     str(impl), MICROBATCHES),
            "relative": relative.loc[absolute.index, absolute.columns],
            "base": base.label, "scale": cal.compute_scale, "breakdown": terms,
        })  # fmt: skip
    return out


def replay_errors(cases: list[Any]) -> dict[str, list[float]]:
    """Per case, each profiled step's replay (its own action times, the calibrated overheads
    and link) over its measured step time, less 1."""
    from vpipe.metrics.per_run import step_metrics
    from vpipe.predict.calibrate import calibrate
    from vpipe.predict.step_replay import action_times
    from vpipe.sim import simulate

    out = {}
    for c in cases:
        ev = c.events[c.events["step"] >= 0]
        cal = calibrate(ev)
        measured = step_metrics(ev).set_index("step")["step_time_s"]
        costs = cal.cost_model(c.schedule)
        out[c.label] = [
            simulate(c.schedule, costs, action_times=times).makespan / 1e6 / measured[step] - 1
            for step, times in sorted(action_times(ev, cal).items())
        ]
    return out


def held_out(table: pd.DataFrame) -> np.ndarray:
    """The off-diagonal cells of a square error table."""
    values = table.to_numpy(dtype=float)
    return values[~np.eye(len(values), dtype=bool)]


def shown(table: pd.DataFrame) -> str:
    return table.map(lambda e: f"{e * 100:+.1f}%").to_string()


def host_line() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"load average {load:.2f}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    from vpipe.sweep.driver import DEFAULT_PROFILE_STEPS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="quiet sweeps (default 3)")
    ap.add_argument("--hog-runs", type=int, default=1, help="sweeps beside a hog (default 1)")
    ap.add_argument("--minutes", type=float, default=3.0, help="budget of each sweep")
    ap.add_argument("--impl", default="vpipe", help="vpipe, torch or both (default vpipe)")
    ap.add_argument("--profile-steps", type=int, default=DEFAULT_PROFILE_STEPS,
                    help=f"profiled steps per config (default {DEFAULT_PROFILE_STEPS}, as vpipe bench)")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per sweep (default 8)")
    ap.add_argument("--steps", type=int, default=4,
                    help="timed steps per config and round (default 4)")
    ap.add_argument("--keep", type=Path, help="keep the sweeps' stores under this folder")
    ap.add_argument("--sweep-args", default="", metavar="ARGS",
                    help="more vpipe bench options for every sweep, joined with '=' as "
                    "they start with a dash: --sweep-args='--cpu-allocator system'")  # fmt: skip
    args = ap.parse_args(argv)
    extra = shlex.split(args.sweep_args)
    from bench.false_alarms import Hog
    from vpipe.predict.timing_noise import outside_timing

    root = args.keep or Path(tempfile.mkdtemp(prefix="vpipe-fidelity-"))
    kinds = ["quiet"] * args.runs + ["hog"] * args.hog_runs
    print(f"fidelity matrix: P={RANKS}, M={MICROBATCHES}, mlp {SIZES}, batch {BATCH}, "
          f"{SCHEDULES}, impl {args.impl}, {args.minutes:g} min per sweep, "
          f"{args.profile_steps} profiled steps per config, {args.rounds} rounds of {args.steps} "
          f"timed steps" + (f", {args.sweep_args}" if extra else ""))  # fmt: skip
    summary = []
    for i, kind in enumerate(kinds, start=1):
        before = host_line()
        out = root / f"run{i}-{kind}"
        if kind == "hog":
            with Hog():
                wall = sweep(out, args.minutes, args.impl, args.profile_steps, args.rounds,
                             args.steps, extra)  # fmt: skip
        else:
            wall = sweep(out, args.minutes, args.impl, args.profile_steps, args.rounds,
                         args.steps, extra)  # fmt: skip
        without = {m["impl"]: m for m in matrices(out, comm_threads=False)}
        for m in matrices(out):
            rel, ab = held_out(m["relative"]), held_out(m["absolute"])
            worst_rel, worst_abs = float(np.abs(rel).max()), float(np.abs(ab).max())
            plain = np.abs(held_out(without[m["impl"]]["absolute"]))
            summary.append((i, kind, m["impl"], worst_rel, worst_abs, np.median(np.abs(ab)),
                            plain.max(), np.median(plain)))  # fmt: skip
            print(f"\nrun {i} ({kind}; {before} before; sweep {wall:.0f} s), {m['impl']}")
            print("absolute error (anchored; rows: calibrated on, columns: predicted):")
            print(shown(m["absolute"]))
            print("relative error (unanchored, to the calibration config's own error):")
            print(shown(m["relative"]))
            own = m["timed"]["own"]
            print("timed steps per config (95% interval of the median): " + ", ".join(
                f"{k} {n} (+-{w * 100:.1f}%)" for k, (n, w) in own.items()))
            print("95% interval of each cell's timed ratio (+-, the larger side):")
            half = np.maximum(m["timed"]["high"] - 1, 1 - m["timed"]["low"])
            print(shown(half.loc[m["absolute"].index, m["absolute"].columns]).replace("+nan%", ""))
            beyond = outside_timing(m["absolute"], m["timed"])
            judged = int(m["timed"]["low"].notna().to_numpy().sum())  # too few steps: no interval
            print(f"cells outside their timed ratio's interval: {len(beyond)} of {judged}"
                  + (f", by at most {max(beyond) * 100:.1f}%" if beyond else ""))
            print("replay of each profiled step with its own action times, error per step:")
            for label, errs in m["replay"].items():
                print(f"  {label:17s} " + " ".join(f"{e * 100:+.1f}%" for e in errs))
            print(f"breakdown, calibrated on {m['base']} (compute scale {m['scale']:.3f}; ms):")
            print(m["breakdown"].round(2).to_string(index=False))
    print("\nrun kind   impl   worst relative  worst absolute  median absolute"
          "  (without comm threads: worst / median absolute)")
    for i, kind, impl, r, a, med, plain_worst, plain_med in summary:
        verdict = "within" if r <= GOAL_RELATIVE and a <= GOAL_ABSOLUTE else "outside"
        print(f"{i:3d} {kind:5s}  {impl:5s}  {r * 100:13.1f}%  {a * 100:13.1f}%  {med * 100:14.1f}%"
              f"  ({plain_worst * 100:.1f}% / {plain_med * 100:.1f}%)"
              f"  {verdict} the goals ({GOAL_RELATIVE:.0%} / {GOAL_ABSOLUTE:.0%})")  # fmt: skip
    if not args.keep:
        print(f"(stores in {root}; pass --keep DIR to keep them somewhere of your choosing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
