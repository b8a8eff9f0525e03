"""The report section of a ``vpipe bench --dp N`` sweep: the data-parallel share of the step
per schedule, measured (exposed vs hidden reduction time, :mod:`vpipe.sweep.dp_bench`) and as
the simulator predicts it, and each rank's reductions."""

from __future__ import annotations

import pandas as pd

from vpipe.report.document import Section, table_section
from vpipe.sweep.results import BenchResults

__all__ = ["dp_sections", "dp_share_table"]


def _ms(x: object) -> str:
    return "" if x is None or pd.isna(x) else f"{float(x) * 1e3:.2f}"


def _pct(x: object) -> str:
    return "" if x is None or pd.isna(x) else f"{float(x):.1%}"


def dp_share_table(res: BenchResults) -> pd.DataFrame:
    """One row per measured config: its timed step, its reductions' time, exposed and hidden
    parts and the DP share (exposed / step), measured and simulated."""
    runs = res.runs
    sims = runs[runs["source"] == "simulated"].set_index("run_id")
    rows = []
    for r in res.measured.to_dict("records"):
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


def rank_table(res: BenchResults) -> pd.DataFrame:
    """Per config and rank (replica x pipeline rank): its stages, and the medians over the
    timed steps of its reductions' time and of the step end's wait for them."""
    f = res.dp_steps
    if f.empty:
        return f
    names = {i: (c.schedule, c.microbatches) for i, c in enumerate(res.spec.configs())}
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


def dp_sections(res: BenchResults) -> list[Section]:
    """The DP share per schedule and the per-rank reductions; none without ``--dp``."""
    spec = res.spec
    if spec.dp <= 1:
        return []
    share = dp_share_table(res)
    if share.empty:
        return []
    note = (
        f"{spec.dp} replicas x {spec.ranks} pipeline ranks ({spec.world_size} processes), each "
        f"replica on {spec.batch // spec.dp} of the {spec.batch} samples; each stage's "
        "gradients all-reduced across the replicas in buckets, started after its last W (or B). "
        "Measured on every rank of every replica in every timed step: per step, the rank that "
        "finished last gives exposed (the step end's wait for its reductions), reducing (the "
        "time its reductions ran, joining the other replicas included) and hidden (reducing - "
        "exposed: under the rest of the schedule); DP share = exposed / the timed step (slowest "
        "of all ranks); medians over the timed steps. sim: the pipeline calibrated from replica "
        "0's profiled steps, plus the reductions with the measured buckets and a ring all-reduce "
        "cost fitted to this config's own measured reductions (in sample for the collective). "
        "Events, bubble, memory, fidelity and plan sections describe replica 0; the fidelity "
        "tables predict the pipeline without its reductions."
    )
    sections = [table_section("Data parallel: DP share per schedule", share, note)]
    ranks = rank_table(res)
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
