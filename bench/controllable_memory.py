"""Controllable memory: every schedule family at P = 8, M = 24 under the zero-bubble paper's
profiled per-stage costs, simulated.

The costs (ms per pipeline stage of one rank, from the table of profiled F, B, W and
communication times in Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, for its
1.5B, 6B, 14B and 28B GPT models on 8 GPUs) are per full stage; a family with v stages per
rank runs stages of 1/v the size, so each of its stages costs F/v, B/v and W/v, while a
message still costs the paper's communication time. For every family that runs at this P and
M (its default stages per rank: the V families 2) the table gives the simulated makespan, the
whole-step bubble ratio and the peak activation memory in 1F1B stages (one microbatch's
activations of 1/P of the model: 1F1B's rank 0 holds P), which depends on the program order
only. A second table runs :func:`vpipe.schedules.auto.auto_schedule` under each model's costs
at memory limits of 2 stages, V-Min's, V-Half's and 1F1B's.

Run: ``python -m bench.controllable_memory [--ranks 8] [--microbatches 24]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# model -> (F, B, W, comm) in ms per full stage
PAPER_COSTS: dict[str, tuple[float, float, float, float]] = {
    "1.5B": (18.522, 18.086, 9.337, 0.601),
    "6B": (29.718, 29.444, 19.927, 0.527),
    "14B": (11.347, 11.248, 8.132, 0.377),
    "28B": (16.181, 16.252, 10.889, 0.651),
}


def costs_for(model: str, stages_per_rank: int):
    """The paper's costs of ``model`` for stages 1/stages_per_rank the size of a full one."""
    from vpipe.sim import CostModel

    f, b, w, comm = PAPER_COSTS[model]
    v = stages_per_rank
    return CostModel(f=f / v, b=b / v, w=w / v, comm_latency=comm)


def family_table(ranks: int, microbatches: int):
    """One row per family that runs at (ranks, microbatches): stages per rank, peak memory in
    1F1B stages (the last model's, for the cost-adapted families), and makespan (ms) and bubble
    ratio per model."""
    import pandas as pd

    from vpipe.errors import ScheduleError
    from vpipe.schedules import catalogue, make_schedule
    from vpipe.sim import simulate

    rows = []
    for family in catalogue.families():
        try:
            s = make_schedule(family.name, ranks, microbatches)
        except ScheduleError:
            continue
        v = s.stages_per_rank
        row: dict[str, object] = {"schedule": family.name, "v": v}
        for model in PAPER_COSTS:
            costs = costs_for(model, v)
            if family.cost_adapted:  # v-half, v-min, auto: built for each model's costs
                s = make_schedule(family.name, ranks, microbatches, costs=costs)
            res = simulate(s, costs)
            row["peak (1F1B stages)"] = max(res.peak_stage_activations) / v
            row[f"{model} ms"] = round(res.makespan, 1)
            row[f"{model} bubble"] = round(res.bubble_ratio, 3)
        rows.append(row)
    return pd.DataFrame(rows)


def auto_table(ranks: int, microbatches: int):
    """auto_schedule on the V placement under each model's costs, at memory limits of 2
    1F1B stages, V-Min's floor((P+4)/3), V-Half's (P+2)/2 and 1F1B's P."""
    import pandas as pd

    from vpipe.schedules.auto import auto_schedule
    from vpipe.sim import simulate

    rows = []
    for model in PAPER_COSTS:
        costs = costs_for(model, 2)
        for limit in (2, (ranks + 4) // 3, (ranks + 2) / 2, ranks):
            s = auto_schedule(ranks, microbatches, costs, limit)
            res = simulate(s, costs)
            source = s.meta["source"]
            rows.append(
                {
                    "model": model,
                    "limit (1F1B stages)": limit,
                    "peak (1F1B stages)": max(res.peak_stage_activations) / 2,
                    "ms": round(res.makespan, 1),
                    "bubble": round(res.bubble_ratio, 3),
                    "picked": source
                    if isinstance(source, str)
                    else _describe(source, s.meta["cap"]),
                }
            )
    return pd.DataFrame(rows)


def _describe(block, cap: int) -> str:
    """A V block as its offsets (down chunk 0 / turn / up chunk 1 for F, then for I), its
    period and the memory cap it was filled under (in V stage-activations)."""
    f, i = block.f_offsets, block.i_offsets
    turn = len(f) // 2
    return (
        f"block F {f[0]}/{f[turn]}/{f[-1]} I {i[-1]}/{i[turn]}/{i[0]} "
        f"period {block.period} cap {cap}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.controllable_memory", description=__doc__)
    ap.add_argument("--ranks", "-p", type=int, default=8)
    ap.add_argument("--microbatches", "-m", type=int, default=24)
    args = ap.parse_args(argv)
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(f"P={args.ranks} M={args.microbatches}, zero-bubble paper costs (ms per stage)")
        print(family_table(args.ranks, args.microbatches).to_string(index=False))
        print()
        print("auto_schedule (V placement) under each model's costs and a memory limit")
        print(auto_table(args.ranks, args.microbatches).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
