"""Where a pipeline step's time goes, vpipe against torch.distributed.pipelining, in an
overhead-bound and a compute-bound configuration.

For each regime one launch sweeps zbv, interleaved-1f1b and dualpipev with both implementations,
interleaved in rounds, then profiles 3 steps per config. Per implementation and schedule it
prints, averaged over profiled steps and ranks:

- the step split into compute, waiting for data, posting communication and everything else
  (:func:`vpipe.metrics.per_run.step_breakdown`; torch's traces have no wait spans, so its waits show
  up under "other");
- the measured bubble ratio minus the schedule's own simulated bubble (the simulator with the
  run's calibrated compute and message costs but no per-action runtime overhead): the share of
  the step the runtime adds. The message costs include gloo's handshake for receives posted
  after their send (:func:`vpipe.predict.calibrate.comm_link_us`); "- own, no hs" leaves it out too;
  "- own, timed" (vpipe only) replays each profiled step with its own actions' times instead
  of the per-stage medians (:mod:`vpipe.predict.step_replay`), so that waits caused by an action the
  host slowed down count as the schedule's, not the runtime's; "- sim" is the measured bubble
  minus the full calibrated simulator's, which charges the runtime's posting and gap costs:
  the prediction's error, not the runtime's overhead;
- vpipe/torch step time: the median of pairwise ratios over the interleaved timed steps, with
  its bootstrap 95% interval.

Run: ``python -m bench.overhead [--rounds 10 --steps 4] [--recv-lookahead N] [--no-bundle]
[--no-post-thread]``
(rounds x steps pairs per schedule; the runtime knobs as on ``vpipe bench``).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import pandas as pd

from vpipe.commands import add_runtime_flags
from vpipe.metrics.per_run import step_breakdown
from vpipe.predict.calibrate import calibrate, predict
from vpipe.predict.step_replay import own_bubbles
from vpipe.report.document import config_times, paired_configs
from vpipe.schedules import make_schedule
from vpipe.sweep.driver import SweepSpec, run_sweep
from vpipe.sweep.results import collect

SCHEDULES = ("interleaved-1f1b", "zbv", "dualpipev")
REGIMES = {
    "overhead-bound (MLP 256/1024, 4-row microbatches)": dict(
        sizes={"d_model": 256, "d_hidden": 1024}, batch=32
    ),
    "compute-bound (MLP 512/2048, 64-row microbatches)": dict(sizes={}, batch=512),
}


def regime_table(spec: SweepSpec) -> pd.DataFrame:
    """One row per (impl, schedule) of one sweep: breakdown, bubble gap, vpipe/torch ratio."""
    res = collect(spec, run_sweep(spec), "overhead", 0.0, simulate=False)
    rows = []
    for r in res.measured.itertuples():
        ev = res.events[r.run_id]
        b = step_breakdown(ev)
        share = b[["compute", "wait", "post", "other"]].sum() / b["window"].sum()
        schedule = make_schedule(r.schedule, spec.ranks, int(r.microbatches))
        full = calibrate(ev)
        cal = replace(full, post=0.0, gap=0.0)
        own, bare, sim = (
            predict(c, schedule, recv_lookahead=spec.recv_lookahead).bubble_ratio
            for c in (cal, replace(cal, comm_handshake=0.0), full)
        )
        # vpipe's traces only: torch's compute spans hold its waits, so its action times
        # are not what computing took
        timed = (
            own_bubbles(ev, full, schedule, recv_lookahead=spec.recv_lookahead)
            if r.impl == "vpipe"
            else None
        )
        row = {
            "impl": r.impl,
            "schedule": r.schedule,
            "step ms": round(r.step_time_s * 1e3, 2),
            **{f"{k} %": round(v * 100, 1) for k, v in share.items()},
            "bubble": round(float(r.bubble_ratio), 3),
            "own bubble": round(own, 3),
            "bubble - own": round(float(r.bubble_ratio) - own, 3),
            "- own, no hs": round(float(r.bubble_ratio) - bare, 3),
            "- own, timed": None if timed is None else round(float(timed["added"].mean()), 3),
            "- sim": round(float(r.bubble_ratio) - sim, 3),
        }
        if r.impl == "vpipe":
            m = int(r.microbatches)
            ratio = paired_configs(
                config_times(res.steps, r.schedule, m, "vpipe"),
                config_times(res.steps, r.schedule, m, "torch"),
            )
            row["vpipe/torch"] = f"{ratio.value:.3f} ({ratio.interval_text(3)}, n={ratio.n})"
        rows.append(row)
    return pd.DataFrame(rows).sort_values(["impl", "schedule"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.overhead", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=4)
    add_runtime_flags(p)
    args = p.parse_args(argv)
    for title, cfg in REGIMES.items():
        spec = SweepSpec(
            schedules=SCHEDULES, microbatches=(8,), impls=("vpipe", "torch"), rounds=args.rounds,
            steps=args.steps, warmup=2, profile_steps=3, progress=False,
            recv_lookahead=args.recv_lookahead, bundle_messages=args.bundle_messages,
            post_thread=args.post_thread, **cfg,
        )  # fmt: skip
        spec.validate()
        print(f"\n{title}: P=2, M=8, batch {spec.batch}, {args.rounds * args.steps} pairs")
        print(regime_table(spec).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
