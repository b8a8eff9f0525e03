"""Several independent launches (blocks) of one sweep, merged into one sweep's results.

Run-to-run variance (a launch's thread placement, memory layout, the host's state in that
minute) is invisible inside one launch; comparing two runs needs it (:mod:`vpipe.report.crossrun`).
``vpipe bench --blocks K`` launches the sweep K times one after the other: only the first
launch profiles and measures memory, every launch times every config in its rounds (the same
rounds: no time budget adds any), and the merged results hold every block's steps, reference
timings and host rounds, each labelled with its block.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vpipe.sweep import driver
from vpipe.sweep.driver import BenchError, SweepSpec


def run_blocks(spec: SweepSpec, bench_id: str) -> list[dict[str, Any]]:
    """Every rank's results of ``spec.blocks`` launches of the sweep, merged
    (:func:`merge_blocks`); [] on a non-coordinating rank of a torchrun job."""
    from vpipe.runtime import launch

    if spec.blocks > 1 and launch.in_torchrun():
        raise BenchError("--blocks needs vpipe bench to launch its ranks (not under torchrun)")
    blocks = []
    for b in range(spec.blocks):
        later = replace(spec, profile=False, memory_step=False)  # merge keeps the first's
        results = driver.run_sweep(spec if b == 0 else later, bench_id)
        if not results:
            return []
        blocks.append(results)
    return merge_blocks(blocks)


def merge_blocks(blocks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per rank: the first block's, with every block's step and reference times,
    communication-thread CPU and rounds appended per config (block after block; rounds
    numbered on across blocks), each step's block, and every block's host rounds (and ``--dp``
    reduction records), each marked with its block."""
    merged = []
    for per_rank in zip(*(sorted(b, key=lambda r: r["rank"]) for b in blocks), strict=True):
        first = dict(per_rank[0])
        offsets, n = [], 0
        for r in per_rank:  # the first round of each block, counted on across blocks
            offsets.append(n)
            n += 1 + max((x for rounds in r["rounds"] for x in rounds), default=-1)
        for key in ("times", "refs", "comm_thread_cpu_s"):  # per config, per step or round
            if key in first:
                first[key] = [sum(rows, []) for rows in zip(*(r[key] for r in per_rank), strict=True)]
        first["rounds"] = [
            [x + offsets[b] for b, rounds in enumerate(rows) for x in rounds]
            for rows in zip(*(r["rounds"] for r in per_rank), strict=True)
        ]
        first["blocks"] = [
            [b for b, rounds in enumerate(rows) for _ in rounds]
            for rows in zip(*(r["rounds"] for r in per_rank), strict=True)
        ]
        first["host_rounds"] = [
            {**row, "block": b, "round": row.get("round", i) + offsets[b]}
            for b, r in enumerate(per_rank)
            for i, row in enumerate(r.get("host_rounds", []))
        ]
        if "dp_steps" in first:  # --dp: every block's reductions
            first["dp_steps"] = [
                {**row, "block": b} for b, r in enumerate(per_rank) for row in r["dp_steps"]
            ]
        merged.append(first)
    return merged
