"""The GPT model's fused forward-backward against plain overlap actions, dualpipev on CPU.

``fused_fb=1`` makes each GPT stage run an ``OVERLAP_F_B`` action's backward part first while
the forward part's input is still being received (``vpipe/models.py``, ``FusedStage``). One
sweep fixes one model, so this script runs ``vpipe bench``'s sweep (dualpipev, vpipe, no
profiling) with ``fused_fb=0`` and ``fused_fb=1`` back to back, alternating A B A B, and prints
each launch's median step time, the medians over all steps of each variant and their ratio
with a bootstrap interval (:func:`vpipe.stats.ratio_of_medians`).

Run: ``python -m bench.fused_overlap --pairs 2``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

from vpipe.stats import ratio_of_medians

SIZES = {"vocab": 512, "d_model": 128, "n_heads": 4, "n_layers": 4, "seq_len": 64}


def step_times(fused: int, sizes: dict[str, int], batch: int, microbatches: int) -> list[float]:
    """One launch of dualpipev on 2 ranks: its timed step times in ms (max over ranks)."""
    from vpipe.sweep.driver import SweepSpec, run_sweep

    spec = SweepSpec(
        model="gpt",
        sizes={**sizes, "fused_fb": fused},
        batch=batch,
        schedules=("dualpipev",),
        microbatches=(microbatches,),
        impls=("vpipe",),
        warmup=3,
        steps=5,
        rounds=4,
        profile=False,
        progress=False,
    )
    (times,) = run_sweep(spec)[0]["times"]
    return [t * 1e3 for t in times]


def compare(pairs: int, sizes: dict[str, int], batch: int, microbatches: int) -> list[str]:
    """The table's lines: each launch in A B A B order, then the medians and their ratio."""
    lines = [f"{'launch':>6}  {'fused_fb':>8}  {'median ms':>9}"]
    every: dict[int, list[float]] = {0: [], 1: []}
    for i in range(pairs):
        for fused in (0, 1):
            got = step_times(fused, sizes, batch, microbatches)
            every[fused] += got
            lines.append(f"{2 * i + fused + 1:>6}  {fused:>8}  {statistics.median(got):>9.1f}")
    off, on = (statistics.median(every[f]) for f in (0, 1))
    r = ratio_of_medians(every[1], every[0])
    lines.append(
        f"all steps: fused_fb=0 {off:.1f} ms, fused_fb=1 {on:.1f} ms, ratio {r.value:.3f} "
        f"(95% CI {r.interval_text(3) or 'n/a'}: {r.verdict('fused slower', 'fused faster')})"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.fused_overlap", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--pairs", type=int, default=2, help="A B launch pairs (default 2)")
    p.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches (default 8)")
    p.add_argument("--d-model", type=int, default=SIZES["d_model"], help="GPT d_model")
    args = p.parse_args(argv)
    sizes = {**SIZES, "d_model": args.d_model}
    for line in compare(args.pairs, sizes, args.batch, args.microbatches):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
