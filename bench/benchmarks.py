"""asv regression benchmarks: vpipe's runtime on a small CPU pipeline, per schedule and M.

One launch per asv run: ``setup_cache`` (asv runs it once and shares its result among the
benchmarks of the class, for every parameter combination) spawns the P ranks once and sweeps
every (schedule, microbatches) parameter set inside that launch, interleaved in rounds as
``vpipe bench`` does; the ``track_`` methods then read one metric each. All tracked values are
"lower is better". The grid is ``vpipe bench``'s default sweep (the catalogue's), M = 4, 8;
``VPIPE_ASV_SCHEDULES`` / ``VPIPE_ASV_MICROBATCHES`` (comma-separated) narrow it, e.g. for a
quick smoke run.
"""

from __future__ import annotations

import os

from vpipe.bench import DEFAULT_SCHEDULES, parse_list

RANKS = 2
BATCH = 16
SIZES = {"d_model": 256, "d_hidden": 1024}
SCHEDULES = parse_list(os.environ.get("VPIPE_ASV_SCHEDULES", ",".join(DEFAULT_SCHEDULES)))
MICROBATCHES = [int(m) for m in parse_list(os.environ.get("VPIPE_ASV_MICROBATCHES", "4,8"))]


class PipelineCPU:
    """2 ranks, gloo, MLP (d_model 256, d_hidden 1024), batch 16, vpipe runtime."""

    params = (SCHEDULES, MICROBATCHES)
    param_names = ("schedule", "microbatches")
    timeout = 600

    def setup_cache(self) -> dict:
        from vpipe.bench import SweepSpec, run_sweep
        from vpipe.bench_results import collect

        spec = SweepSpec(
            ranks=RANKS,
            model="mlp",
            sizes=SIZES,
            batch=BATCH,
            schedules=tuple(SCHEDULES),
            microbatches=tuple(MICROBATCHES),
            impls=("vpipe",),
            warmup=2,
            steps=3,
            rounds=3,
            profile=True,
            progress=False,
        )
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            spec.trace_dir = tmp
            res = collect(spec, run_sweep(spec), "asv", 0.0, simulate=False)
        runs = res.measured
        peaks = res.ranks.groupby(["schedule", "microbatches"])["peak_bytes"].max()
        out = {}
        for row in runs.itertuples():
            key = f"{row.schedule}/{int(row.microbatches)}"
            out[key] = {
                "step": float(row.step_time_s),
                "sample": float(row.step_time_s) / BATCH,
                "peak": int(peaks[(row.schedule, int(row.microbatches))]),
                "bubble": float(row.bubble_ratio),
            }
        return out

    setup_cache.timeout = 600

    def track_seconds_per_step(self, cache: dict, schedule: str, microbatches: int) -> float:
        return cache[f"{schedule}/{microbatches}"]["step"]

    track_seconds_per_step.unit = "seconds"

    def track_seconds_per_sample(self, cache: dict, schedule: str, microbatches: int) -> float:
        return cache[f"{schedule}/{microbatches}"]["sample"]

    track_seconds_per_sample.unit = "seconds"

    def track_peak_bytes_per_rank(self, cache: dict, schedule: str, microbatches: int) -> int:
        return cache[f"{schedule}/{microbatches}"]["peak"]

    track_peak_bytes_per_rank.unit = "bytes"

    def track_bubble_ratio(self, cache: dict, schedule: str, microbatches: int) -> float:
        return cache[f"{schedule}/{microbatches}"]["bubble"]

    track_bubble_ratio.unit = "ratio"
