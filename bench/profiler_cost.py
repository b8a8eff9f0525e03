"""What profiling costs the step it measures: user spans only (the default) against every op.

Per schedule (P=2, M=8) and A/B, one launch times 12 unprofiled steps, 12 under
torch.profiler, then 12 unprofiled again, and prints the profiled steps' median over the mean
of the two unprofiled medians (the slower rank's ratio), recording every aten op ("all") or
user spans only ("user", :mod:`vpipe.trace.scopes`), alternately.

``--impl torch`` runs torch.distributed.pipelining's classes instead of vpipe's runtime (what
recording torch's operators, from which vpipe reads its waits, costs against spans only).

Run: ``python -m bench.profiler_cost [--compute-bound] [--reps 2] [--impl torch]``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from contextlib import nullcontext

from bench.runtime_knobs import REGIMES, SCHEDULES

STEPS = 12


def _profiled_over_plain(
    rank: int, n_ranks: int, schedule: str, regime: str, user: bool, impl: str = "vpipe"
) -> float:
    from torch.profiler import ProfilerActivity, profile

    from vpipe.schedules import make_schedule
    from vpipe.sweep.harness import RankSpec, build
    from vpipe.trace.scopes import user_scope_only

    h = build(RankSpec(make_schedule(schedule, n_ranks, 8), impl=impl, **REGIMES[regime]), rank)
    h.timed_step()
    h.timed_step()
    plain = [statistics.median(h.timed_step() for _ in range(STEPS))]
    # the pipeline sees the profiler and records its action spans
    with user_scope_only() if user else nullcontext(), profile(activities=[ProfilerActivity.CPU]):
        profiled = statistics.median(h.timed_step() for _ in range(STEPS))
    plain.append(statistics.median(h.timed_step() for _ in range(STEPS)))
    return profiled / statistics.mean(plain)


def main(argv: Sequence[str] | None = None) -> int:
    from vpipe.runtime.launch import spawn
    from vpipe.trace.quiet import filtered_stderr

    p = argparse.ArgumentParser(
        prog="python -m bench.profiler_cost", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--compute-bound", action="store_true", help="the default sweep's MLP")
    p.add_argument("--reps", type=int, default=2, help="A/Bs per schedule")
    p.add_argument("--impl", choices=("vpipe", "torch"), default="vpipe")
    args = p.parse_args(argv)
    regime = "compute-bound" if args.compute_bound else "overhead-bound"
    print(f"{args.impl} {regime}: P=2, M=8; profiled step median / unprofiled, {STEPS} steps each")
    for schedule in SCHEDULES:
        ratios: dict[str, list[float]] = {"all": [], "user": []}
        for _ in range(args.reps):
            for name, user in (("all", False), ("user", True)):
                with filtered_stderr():
                    per_rank = spawn(_profiled_over_plain, 2, schedule, regime, user, args.impl)
                ratios[name].append(max(per_rank))
        shown = "; ".join(f"{k} {', '.join(f'{r:.3f}' for r in v)}" for k, v in ratios.items())
        print(f"{schedule:17} {shown}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
