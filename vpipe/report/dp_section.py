"""The report section of a ``vpipe bench --dp N`` sweep: the data-parallel share of the step
per schedule, measured (exposed vs hidden reduction time, :mod:`vpipe.sweep.dp_bench`) and as
the simulator predicts it, each rank's reductions, and the plan section's data-parallel side.
It reads the sweep through :class:`DPSweep`, which the sweep layer fills."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd

from vpipe.report.document import Section, table_section

if TYPE_CHECKING:
    from vpipe.predict.dp_costs import DPCosts

__all__ = ["DPSweep", "dp_sections", "dp_share_table", "plan_dp"]


@dataclass(frozen=True)
class DPSweep:
    """What these sections read of a sweep: its replicas, pipeline ranks, global batch and
    bucket size (None: the default), each config's (schedule, microbatches) by its index in
    ``dp_steps``, the runs table (measured and simulated rows) and every rank's reductions per
    timed step (:func:`vpipe.sweep.dp_bench.steps_frame`)."""

    replicas: int
    ranks: int
    batch: int
    bucket_bytes: int | None
    configs: tuple[tuple[str, int], ...]
    runs: pd.DataFrame
    dp_steps: pd.DataFrame

    @property
    def world_size(self) -> int:
        return self.replicas * self.ranks


def _ms(x: object) -> str:
    return "" if x is None or pd.isna(x) else f"{float(x) * 1e3:.2f}"


def _pct(x: object) -> str:
    return "" if x is None or pd.isna(x) else f"{float(x):.1%}"


def dp_share_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per measured config of a runs table: its timed step, its reductions' time,
    exposed and hidden parts and the DP share (exposed / step), measured and simulated."""
    sims = runs[runs["source"] == "simulated"].set_index("run_id")
    rows = []
    for r in runs[runs["source"] == "measured"].to_dict("records"):
        if "dp_exposed_s" not in r or pd.isna(r["dp_exposed_s"]):
            continue
        sim_id = f"{r['run_id']}-sim"
        s = sims.loc[sim_id].to_dict() if sim_id in sims.index else {}
        rows.append(
            {
                "schedule": r["schedule"],
                "M": int(r["microbatches"]),
                "step ms": _ms(r["step_time_s"]),
                "reducing ms": _ms(r["dp_reduce_s"]),
                "exposed ms": _ms(r["dp_exposed_s"]),
                "hidden ms": _ms(r["dp_hidden_s"]),
                "DP share": _pct(r["dp_share"]),
                "sim step ms": _ms(s.get("step_time_s")),
                "sim exposed ms": _ms(s.get("dp_exposed_s")),
                "sim hidden ms": _ms(s.get("dp_hidden_s")),
                "sim DP share": _pct(s.get("dp_share")),
                "MiB/replica": f"{r['dp_bytes'] / 2**20:.2f}",
                "buckets": int(r["dp_buckets"]),
            }
        )
    return pd.DataFrame(rows)


def rank_table(d: DPSweep) -> pd.DataFrame:
    """Per config and rank (replica x pipeline rank): its stages, and the medians over the
    timed steps of its reductions' time and of the step end's wait for them."""
    f = d.dp_steps
    if f.empty:
        return f
    names = dict(enumerate(d.configs))
    g = f.groupby(["config", "rank"], sort=True).agg(
        replica=("replica", "first"),
        pp_rank=("pp_rank", "first"),
        stages=("stages", "first"),
        busy=("busy_s", "median"),
        wait=("wait_s", "median"),
    )
    return pd.DataFrame(
        {
            "schedule": names[c][0],
            "M": names[c][1],
            "rank": rank,
            "replica": row.replica,
            "pipeline rank": row.pp_rank,
            "stages": row.stages,
            "reducing ms": _ms(row.busy),
            "waited ms": _ms(row.wait),
        }
        for (c, rank), row in g.iterrows()
    )


def dp_sections(d: DPSweep) -> list[Section]:
    """The DP share per schedule and the per-rank reductions; none without ``--dp``."""
    if d.replicas <= 1:
        return []
    share = dp_share_table(d.runs)
    if share.empty:
        return []
    note = (
        f"{d.replicas} replicas x {d.ranks} pipeline ranks ({d.world_size} processes), each "
        f"replica on {d.batch // d.replicas} of the {d.batch} samples; each stage's "
        "gradients all-reduced across the replicas in buckets, started after its last W (or B). "
        "Measured on every rank of every replica in every timed step: per step, the rank that "
        "finished last gives exposed (the step end's wait for its reductions), reducing (the "
        "time its reductions ran, joining the other replicas included) and hidden (reducing - "
        "exposed: under the rest of the schedule); DP share = exposed / the timed step (slowest "
        "of all ranks); medians over the timed steps. sim: the pipeline calibrated from replica "
        "0's profiled steps, plus the reductions with the measured buckets and a ring all-reduce "
        "cost fitted to this config's own measured reductions (in sample for the collective). "
        "Medians are taken separately (reducing need not equal exposed + hidden). Events, "
        "bubble, memory and fidelity sections describe replica 0, and the fidelity tables "
        "predict the pipeline without its reductions; the plan includes them."
    )
    sections = [table_section("Data parallel: DP share per schedule", share, note)]
    ranks = rank_table(d)
    if len(ranks):
        sections.append(
            table_section(
                "Data parallel: reductions per rank",
                ranks,
                "medians over the timed steps: the time the rank's reductions ran, and how "
                "long its step's end waited for them.",
            )
        )
    return sections


def plan_dp(d: DPSweep, run_id: str) -> tuple[DPCosts | None, str]:
    """The plan section's data-parallel side for a ``--dp`` sweep: this sweep's replicas, the
    gradient bytes per full stage (1/P of the model) measured, and the ring all-reduce cost
    fitted to the reductions of the run the plan is calibrated on; with a sentence saying so.
    (None, "") without ``--dp`` or a simulated row to take the link from."""
    from vpipe.predict.dp_costs import DPCosts

    runs = d.runs
    sim = runs[runs["run_id"] == f"{run_id}-sim"]
    measured = runs[runs["run_id"] == run_id]
    if d.replicas <= 1 or sim.empty or "dp_bandwidth_GBps" not in sim or measured.empty:
        return None, ""
    link, grads = sim.iloc[0], float(measured.iloc[0]["dp_bytes"])
    bucket_mb = (d.bucket_bytes or 25 * 2**20) / 2**20
    costs = DPCosts(
        d.replicas,
        grad_bytes=grads / d.ranks,
        bw=float(link["dp_bandwidth_GBps"]),
        lat=float(link["dp_latency_us"]),
        bucket_mb=bucket_mb,
    )
    return costs, (
        f" Each candidate's step ends with its reductions across {d.replicas} replicas (the "
        f"global batch {d.batch} sharded): {grads / 2**20:.2f} MiB of gradients per replica in "
        f"{bucket_mb:g} MiB buckets, a ring at {costs.bw:.3g} GB/s and {costs.lat:.3g} us per ring "
        "step, fitted to that run's reductions."
    )
