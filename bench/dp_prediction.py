"""A calibrated P=2 x DP=2 prediction against the timed median (gloo, 4 local processes).

One launch: per schedule, a pipeline of 2 ranks replicated twice (``RankSpec.dp``), warmed
up, timed for ``--steps`` steps (each step's time the slowest rank's), then profiled for one
step. The pipeline's costs are calibrated from replica 0's profiled event table
(:func:`vpipe.predict.calibrate.calibrate`), the collective's (latency per ring step,
bandwidth) fitted to the reductions of the timed steps that did not queue
(:func:`vpipe.sweep.dp_report.fit_collective`), and the simulator's step with its reductions
(:func:`vpipe.sim.collectives.simulate_reductions`) is compared with the timed median; also the
exposed share of the step, measured (the step end's wait for the reductions) and predicted.

Run: ``python -m bench.dp_prediction [--steps 10] [--schedules 1f1b,zbv]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any


def rank_worker(rank: int, world: int, names: list[str], args: Any, out: str) -> dict:
    import torch
    import torch.distributed as dist

    from vpipe.schedules import make_schedule
    from vpipe.sweep.harness import RankSpec, build

    results = {}
    for name in names:
        spec = RankSpec(
            make_schedule(name, 2, args.microbatches),
            model="mlp",
            batch=args.batch,
            dp=2,
            dp_bucket_bytes=int(args.bucket_mb * 2**20),
        )
        h = build(spec, rank)
        for _ in range(2):
            h.timed_step()
        times, waits, reductions = [], [], []
        for _ in range(args.steps):
            t = torch.tensor([h.timed_step()], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t))
            waits.append(h.stats["dp_wait_s"] / h.stats["step_time_s"])
            reductions += [{**r, "rank": rank} for r in h.stats["reductions"]]
        events = h.profiled_step(f"{out}/{name}", {"run_id": name, "schedule": name})
        results[name] = {
            "times": times,
            "wait_share": statistics.median(waits),
            "reductions": reductions,
            "events": events if h.replica == 0 else None,
            "buckets": h.pipe.reducer.bucket_bytes(),
        }
    return results


def predict(name: str, per_rank: list[dict], args: Any) -> dict[str, float]:
    import pandas as pd

    from vpipe.predict.calibrate import calibrate
    from vpipe.schedules import make_schedule
    from vpipe.sim import simulate
    from vpipe.sim.collectives import CollectiveCost, simulate_reductions
    from vpipe.sweep.dp_report import fit_collective

    schedule = make_schedule(name, 2, args.microbatches)
    frames = [r[name]["events"] for r in per_rank if r[name]["events"] is not None]
    events = pd.concat(frames, ignore_index=True)
    cm = calibrate(events).cost_model(schedule)
    sim = simulate(schedule, cm, recv_lookahead=1)
    link = fit_collective([x for r in per_rank for x in r[name]["reductions"]], group=2)
    buckets: dict[int, list[float]] = {}
    for r in per_rank[:2]:
        for (stage, _), nbytes in sorted(r[name]["buckets"].items()):
            buckets.setdefault(stage, []).append(float(nbytes))
    step = simulate_reductions(
        schedule,
        sim.columns,
        sim.makespan,
        CollectiveCost(2, link["bandwidth"], link["latency"]),
        buckets,
    )
    times = [t for t in per_rank[0][name]["times"]]
    measured = statistics.median(times) * 1e3
    predicted = step.step_end / 1e3
    return {
        "measured_ms": measured,
        "predicted_ms": predicted,
        "error": predicted / measured - 1,
        "pipeline_ms": sim.makespan / 1e3,
        "measured_wait_share": statistics.median(r[name]["wait_share"] for r in per_rank),
        "predicted_dp_share": step.dp_share,
        "latency_us": link["latency"],
        "bandwidth_GBps": link["bandwidth"] / 1e3,
    }


def main(argv: list[str] | None = None) -> None:
    from vpipe.runtime.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="1f1b,zbv")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    args = ap.parse_args(argv)
    names = args.schedules.split(",")
    with tempfile.TemporaryDirectory() as out:
        per_rank = spawn(rank_worker, 4, names, args, out, timeout_s=1200)
    print(
        f"{'schedule':<10}{'timed ms':>10}{'predicted':>11}{'error':>8}{'pipeline':>10}"
        f"{'wait share':>12}{'pred share':>12}{'lat us':>8}{'GB/s':>7}"
    )
    for name in names:
        p = predict(name, per_rank, args)
        print(
            f"{name:<10}{p['measured_ms']:>10.1f}{p['predicted_ms']:>11.1f}{p['error']:>8.1%}"
            f"{p['pipeline_ms']:>10.1f}{p['measured_wait_share']:>12.1%}"
            f"{p['predicted_dp_share']:>12.1%}{p['latency_us']:>8.0f}{p['bandwidth_GBps']:>7.2f}"
        )


if __name__ == "__main__":
    main()
