"""Pipeline x data parallel in a sweep (``vpipe bench --dp N``): what each rank's timed steps
reduced, the DP share of the step measured from them, and the simulator's prediction of it.

A ``--dp N`` sweep runs P x N processes (replica = rank // P, pipeline rank = rank % P; each
replica on its shard of the global batch: :class:`vpipe.sweep.harness.RankSpec`). After every
timed step each of the P x N ranks notes its reductions (:func:`step_record`: every bucket's
start and end, from ``Pipeline.stats["reductions"]``) and how long the step's end waited for
them (``stats["dp_wait_s"]``). Per timed step the rank that finished its step last decides:

- **exposed**: its wait at the step's end for its reductions (what the step grew by);
- **reducing**: the time its reductions ran (the union of their spans; they run one after
  another on the rank's collective stream, and on gloo this includes waiting for the other
  replicas to join);
- **hidden**: reducing less exposed (reduction time under the rest of the schedule);
- **DP share**: exposed over the timed step (the slowest of all P x N ranks).

Medians over the timed steps of every block. The simulator's prediction
(:func:`simulate_dp`) adds the reductions to the calibrated pipeline step
(:func:`vpipe.sim.collectives.simulate_reductions`) with the measured bucket sizes and a ring
all-reduce cost fitted to this config's own measured reductions
(:func:`vpipe.sweep.dp_report.fit_collective`), so the collective term is in-sample.
Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

__all__ = ["check_dp_sweep", "measured_dp", "simulate_dp", "step_record", "steps_frame"]

_REDUCTION_KEYS = ("stage", "bucket", "bytes", "start_ns", "end_ns")


def check_dp_sweep(spec: Any) -> None:
    """Refuse a ``--dp`` sweep (a :class:`vpipe.sweep.driver.SweepSpec` with ``dp > 1``)
    that cannot run, in one line and before any process starts: torch's implementation, a
    batch that does not shard into replicas x microbatches, a torchrun world that is not
    ranks x replicas, a backend that cannot reduce on the device."""
    from vpipe.runtime import launch
    from vpipe.runtime.data_parallel import DataParallelError, check_layout

    if "torch" in spec.impls:
        raise DataParallelError(
            "--dp runs vpipe's runtime only: leave torch out of --impl (--impl vpipe)"
        )
    for m in spec.microbatches:
        if m > 0 and spec.batch % (spec.dp * m):
            raise DataParallelError(
                f"batch {spec.batch} does not shard into {spec.dp} replicas x {m} microbatches"
            )
    world = int(os.environ["WORLD_SIZE"]) if launch.in_torchrun() else spec.world_size
    check_layout(world, spec.ranks, spec.dp, spec.backend, spec.device)


def step_record(config: int, step: int, rank: int, pp: int, harness: Any) -> dict[str, Any]:
    """This rank's reductions in its last step (``harness.stats``), picklable: the config's
    index, the timed step's index, the rank, its replica and pipeline rank, the step's wait
    for the reductions, the rank's own step time and each bucket's reduction."""
    stats = harness.stats
    return {
        "config": config,
        "step": step,
        "rank": rank,
        "replica": rank // pp,
        "pp_rank": rank % pp,
        "wait_s": float(stats.get("dp_wait_s", 0.0)),
        "pipe_step_s": float(stats.get("step_time_s", 0.0)),
        "reductions": [{k: r[k] for k in _REDUCTION_KEYS} for r in stats.get("reductions", [])],
    }


def busy_seconds(reductions: Sequence[Mapping[str, Any]]) -> float:
    """The union of the reductions' spans [start_ns, end_ns], in seconds."""
    total, free = 0, None
    for r in sorted(reductions, key=lambda r: r["start_ns"]):
        start = r["start_ns"] if free is None else max(r["start_ns"], free)
        total += max(0, r["end_ns"] - start)
        free = r["end_ns"] if free is None else max(free, r["end_ns"])
    return total / 1e9


def steps_frame(records: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per (config, block, step, rank) of :func:`step_record` records: the wait, the
    rank's step, its reductions' busy time, bytes, buckets and stages."""
    rows = [
        {
            "config": r["config"],
            "block": r.get("block", 0),
            "step": r["step"],
            "rank": r["rank"],
            "replica": r["replica"],
            "pp_rank": r["pp_rank"],
            "stages": ",".join(str(s) for s in sorted({x["stage"] for x in r["reductions"]})),
            "buckets": len(r["reductions"]),
            "bytes": sum(x["bytes"] for x in r["reductions"]),
            "busy_s": busy_seconds(r["reductions"]),
            "wait_s": r["wait_s"],
            "pipe_step_s": r["pipe_step_s"],
        }
        for r in records
    ]
    return pd.DataFrame(rows)


def measured_dp(frame: pd.DataFrame, times: Sequence[float], per_block: int) -> dict[str, Any]:
    """One config's measured DP figures (see the module docstring) from its rows of
    :func:`steps_frame` and its timed steps (``times``, ``per_block`` of them per block)."""
    picked = []
    for (block, step), g in frame.groupby(["block", "step"], sort=True):
        last = g.loc[g["pipe_step_s"].idxmax()]
        timed = times[int(block) * per_block + int(step)]
        picked.append(
            (
                last["busy_s"],
                last["wait_s"],
                max(0.0, last["busy_s"] - last["wait_s"]),
                last["wait_s"] / timed if timed > 0 else 0.0,
            )
        )
    if not picked:
        return {}
    reduce_s, exposed, hidden, share = (statistics.median(c) for c in zip(*picked, strict=True))
    replica0 = frame[(frame["replica"] == 0)]
    first = replica0[(replica0["block"] == 0) & (replica0["step"] == replica0["step"].min())]
    return {
        "dp_reduce_s": reduce_s,
        "dp_exposed_s": exposed,
        "dp_hidden_s": hidden,
        "dp_share": share,
        "dp_bytes": int(first["bytes"].sum()),  # one replica's gradients, one step
        "dp_buckets": int(first["buckets"].sum()),
    }


def simulate_dp(
    dp: int, schedule: Any, sim: Any, records: Sequence[Mapping[str, Any]]
) -> tuple[Any, dict[str, Any]]:
    """``sim`` (the calibrated pipeline's SimResult, in microseconds) with its step ended by
    the reductions, and the predicted DP figures: each stage's measured buckets, reduced with
    a ring all-reduce cost fitted to the measured reductions of ``records`` (this config's
    :func:`step_record` records from every rank)."""
    from vpipe.sim.collectives import CollectiveCost, simulate_reductions
    from vpipe.sweep.dp_report import fit_collective

    reductions = [{**x, "rank": r["rank"]} for r in records for x in r["reductions"]]
    link = fit_collective(reductions, dp)  # latency in us, bandwidth in bytes per us
    buckets: dict[int, dict[int, float]] = {}
    for x in reductions:
        buckets.setdefault(x["stage"], {})[x["bucket"]] = float(x["bytes"])
    step = simulate_reductions(
        schedule,
        sim.columns,
        sim.makespan,
        CollectiveCost(dp, link["bandwidth"], link["latency"]),
        {s: [b[k] for k in sorted(b)] for s, b in buckets.items()},
    )
    return dataclasses.replace(sim, makespan=step.step_end), {
        "dp_reduce_s": (step.hidden + step.exposed) * 1e-6,  # on the rank DPStep.hidden names
        "dp_exposed_s": step.exposed * 1e-6,
        "dp_hidden_s": step.hidden * 1e-6,
        "dp_share": step.dp_share,
        "pipeline_step_s": step.pipeline_end * 1e-6,
        "dp_latency_us": link["latency"],
        "dp_bandwidth_GBps": link["bandwidth"] / 1e3,
    }
