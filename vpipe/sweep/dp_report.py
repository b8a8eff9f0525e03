"""What a pipeline x data-parallel run's reductions cost, measured: per rank, the reductions of
its stages (buckets, bytes, how long they ran from the gradients being complete to done) and
what the step's end waited for them (the exposed share of the step); and a collective cost fitted
to them for the simulator (:mod:`vpipe.sim.collectives`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["fit_collective", "print_reductions", "reduction_summary"]


def reduction_summary(stats: Mapping[str, Any]) -> dict[str, Any]:
    """One rank's last step (``Pipeline.stats``): stages, buckets, bytes, the time from its
    first reduction's start to its last's end, the wait at the step's end, the step."""
    reds = stats.get("reductions") or []
    span = (max(r["end_ns"] for r in reds) - min(r["start_ns"] for r in reds)) / 1e9 if reds else 0
    return {
        "stages": sorted({r["stage"] for r in reds}),
        "buckets": len(reds),
        "bytes": sum(r["bytes"] for r in reds),
        "reduce_s": span,
        "wait_s": float(stats.get("dp_wait_s", 0.0)),
        "step_s": float(stats.get("step_time_s", 0.0)),
    }


def print_reductions(rank: int, world: int, stats: Mapping[str, Any], pp: int) -> None:
    """Gather every rank's :func:`reduction_summary` (collective) and print them on rank 0."""
    import torch.distributed as dist

    mine = reduction_summary(stats)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return
    print(f"data parallel: {world // pp} replicas x {pp} pipeline ranks; last step's reductions:")
    for r, s in enumerate(everyone):
        share = s["wait_s"] / s["step_s"] if s["step_s"] else 0.0
        print(
            f"  rank {r} (replica {r // pp}, pipeline rank {r % pp}) stages {s['stages']}: "
            f"{s['buckets']} buckets, {s['bytes'] / 2**20:.2f} MiB, reducing "
            f"{s['reduce_s'] * 1e3:.2f} ms, step end waited {s['wait_s'] * 1e3:.2f} ms "
            f"({share:.1%} of the step, exposed)",
            flush=True,
        )


def fit_collective(reductions: Sequence[Mapping[str, Any]], group: int) -> dict[str, float]:
    """A ring all-reduce cost (``latency`` per ring step in us, ``bandwidth`` in bytes per us)
    fitted by least squares to measured reductions (``rank``, ``bytes``, ``start_ns``,
    ``end_ns``). A rank's reductions run one after another, as the simulator's collective
    stream runs them: each one's own time is from its start, or the previous one's end if
    later, to its end. With one size only, the latency is 0 and the bandwidth their median
    rate."""
    steps = 2 * (group - 1)
    by_rank: dict[Any, list] = {}
    for r in reductions:
        by_rank.setdefault(r.get("rank"), []).append(r)
    xs, ys = [], []
    for rows in by_rank.values():
        free = -1
        for r in sorted(rows, key=lambda r: r["start_ns"]):
            xs.append(2 * (group - 1) / group * r["bytes"])
            ys.append((r["end_ns"] - max(r["start_ns"], free)) / 1e3)
            free = max(free, r["end_ns"])
    if not xs:
        raise ValueError("no measured reduction to fit a collective cost to")
    if len(set(xs)) < 2:
        rate = statistics.median(x / y for x, y in zip(xs, ys, strict=True))
        return {"latency": 0.0, "bandwidth": rate}
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = max(cov / sum((x - mx) ** 2 for x in xs), 1e-12)
    return {"latency": max(0.0, (my - slope * mx) / steps), "bandwidth": 1.0 / slope}
