"""vpipe's runtime knobs A/B: receive lookahead, message bundling, shape agreement,
per-direction channel groups and the poster thread against the defaults.

One launch per schedule builds every variant's rank harness in the same processes (P=2, M=8)
and times their steps alternately (A B C, then C B A, ...), so machine noise hits all of them;
each step's time is the slowest rank's. For each variant it prints the median of pairwise
ratios against the default (lookahead 1, bundling on, shapes agreed at the first step only,
one process group: channels are the default on NCCL only; gloo operations posted by the
poster thread) with its bootstrap 95% interval
(:func:`vpipe.stats.paired_ratio`). For schedules without bundles (all but dualpipev)
``--no-bundle`` runs the very same code, so its ratio shows the noise floor.

Run: ``python -m bench.runtime_knobs [--steps 60] [--compute-bound]``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "lookahead 0": {"recv_lookahead": 0},
    "lookahead 2": {"recv_lookahead": 2},
    "lookahead 3": {"recv_lookahead": 3},
    "no bundling": {"bundle_messages": False},
    "shapes every step": {"static_shapes": False},
    "channels": {"comm_channels": True},
    "no post thread": {"post_thread": False},
}
SCHEDULES = ("interleaved-1f1b", "zbv", "dualpipev")
REGIMES = {
    "overhead-bound": {"sizes": {"d_model": 256, "d_hidden": 1024}, "batch": 32},
    "compute-bound": {"sizes": {}, "batch": 512},
}


def _alternate(rank: int, n_ranks: int, specs: list[Any], steps: int) -> list[list[float]]:
    """This rank's step times per variant, the variants' order reversed every other step."""
    from vpipe.sweep.harness import build

    harnesses = [build(spec, rank) for spec in specs]
    for h in harnesses:
        h.timed_step()
        h.timed_step()
    times: list[list[float]] = [[] for _ in harnesses]
    order = list(range(len(harnesses)))
    for k in range(steps):
        for i in order if k % 2 == 0 else order[::-1]:
            times[i].append(harnesses[i].timed_step())
    return times


def knob_ratios(schedule: str, regime: str, steps: int) -> tuple[float, dict[str, Any]]:
    """The default's median step time, and each other variant's paired ratio to it."""
    from vpipe.runtime.launch import spawn
    from vpipe.schedules import make_schedule
    from vpipe.stats import paired_ratio
    from vpipe.sweep.harness import RankSpec

    base = RankSpec(make_schedule(schedule, 2, 8), **REGIMES[regime])
    specs = [replace(base, **knobs) for knobs in VARIANTS.values()]
    per_rank = spawn(_alternate, 2, specs, steps, timeout_s=1800)
    slowest = [list(map(max, *(r[i] for r in per_rank))) for i in range(len(specs))]
    ratios = {
        name: paired_ratio(slowest[i], slowest[0]) for i, name in enumerate(VARIANTS) if i > 0
    }
    return statistics.median(slowest[0]), ratios


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.runtime_knobs", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--steps", type=int, default=60, help="timed steps per variant")
    p.add_argument("--compute-bound", action="store_true", help="the default sweep's MLP")
    args = p.parse_args(argv)
    regime = "compute-bound" if args.compute_bound else "overhead-bound"
    print(f"{regime}: P=2, M=8, {args.steps} pairs per variant; ratio to the default")
    for schedule in SCHEDULES:
        median, ratios = knob_ratios(schedule, regime, args.steps)
        cells = [f"default {median * 1e3:.1f} ms"]
        cells += [f"{name} {r.value:.3f} ({r.interval_text(3)})" for name, r in ratios.items()]
        print(f"{schedule:17s} " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
