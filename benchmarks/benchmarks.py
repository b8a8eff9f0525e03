"""asv regression benchmarks: vpipe's runtime on a small CPU pipeline, per schedule and M.

One launch per round: ``setup_cache`` (asv runs it once per benchmarking process and shares its
result among the benchmarks of the class, for every parameter combination) spawns the P ranks
once and sweeps every (schedule, microbatches) parameter set inside that launch, interleaved in
rounds as ``vpipe bench`` does. The grid is ``vpipe bench``'s default sweep (the catalogue's),
M = 4, 8. The ``track_`` methods are generated from the metric registry
(:mod:`vpipe.metrics.catalogue`): one per metric with an asv
:class:`~vpipe.metrics.catalogue.Track`, reading that metric from the sweep's runs table, with
its unit. asv takes lower as better, so a higher-is-better metric is tracked through its
reciprocal (samples/s as ``track_seconds_per_sample``). ``VPIPE_ASV_SCHEDULES`` /
``VPIPE_ASV_MICROBATCHES`` (comma-separated) narrow the parameter grid, e.g. for a quick smoke
run; ``VPIPE_ASV_DTYPE`` sets the precision (``vpipe bench --dtype``), ``VPIPE_ASV_RECOMPUTE``
the activation recomputation (``vpipe bench --recompute``: none, full or selective).

**Rounds across commits.** ``asv continuous --interleave-rounds -a rounds=7 A B`` (asv's
default is to interleave when it makes its own environments) runs round 1 of both commits,
then round 2 in the other order, and so on, each round a fresh process and so a fresh
``setup_cache`` launch: the two commits alternate in time, and whatever the host does
meanwhile hits both. The rounds come from the command line (:data:`ROUNDS` is the number the
documentation gives): asv reads a ``rounds`` attribute from timing benchmarks only, and these
are tracks. Each track returns its round's figure as asv's timing benchmarks return theirs
(``{"samples": [value], "number": 1}``), so asv keeps one sample per round and compares the two
commits' samples (Mann-Whitney U from 7 rounds: with 6 a complete separation cannot reach
asv's p < 0.002) rather than the last round's value. Without interleaving (``asv run
--python=same``) every round reads the same cache: only its first reading is a sample (a
marker file in asv's cache directory remembers it).

Across commits the host changes, so the step is tracked as
``track_normalised_step_in_ref_units`` (asv prints units only for seconds and bytes, so the
name carries it): each
config's median step time over the median time of the host-speed reference timed before
every step (:mod:`vpipe.sweep.reference`), in units of the reference (a dimensionless figure
that a uniformly slower host leaves unchanged), the median over ``VPIPE_ASV_BLOCKS`` launches
per round (default 1); raw seconds and bubble ratios are in the reports, not tracked. A sweep
during which other processes kept more than half a core busy gives no sample of its timings
(the reason goes to stderr, which ``--show-stderr`` shows): the reference over-corrects for a
busy core (``VPIPE_ASV_ALLOW_BUSY=1`` records it anyway). Its peak bytes, which other
processes do not move, are still samples. ``VPIPE_ASV_INJECT_DELAY_MS`` sleeps that long
per step on rank 0 (``vpipe bench --inject-delay-ms``), to check that a real slowdown shows.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from vpipe.metrics.catalogue import Metric, registry
from vpipe.sweep.cli_lists import parse_list
from vpipe.sweep.driver import DEFAULT_SCHEDULES

RANKS = 2
# Compute-bound, as bench.false_alarms: actions of milliseconds, so a launch's figure is not
# the spread of thread wake-ups (MLP 256/1024 at batch 16: steps spread 15-25% in log)
BATCH = 128
SIZES = {"d_model": 512, "d_hidden": 2048}
SCHEDULES = parse_list(os.environ.get("VPIPE_ASV_SCHEDULES", ",".join(DEFAULT_SCHEDULES)))
MICROBATCHES = [int(m) for m in parse_list(os.environ.get("VPIPE_ASV_MICROBATCHES", "4,8"))]
BLOCKS = int(os.environ.get("VPIPE_ASV_BLOCKS", "1"))
ROUNDS = 7  # asv continuous --interleave-rounds -a rounds=7 (see the module's doc)
INJECT_DELAY_MS = float(os.environ.get("VPIPE_ASV_INJECT_DELAY_MS", "0"))
DTYPE = os.environ.get("VPIPE_ASV_DTYPE") or None  # bf16, fp16, fp32 (default: fp32 on CPU)
RECOMPUTE = os.environ.get("VPIPE_ASV_RECOMPUTE") or "none"  # none, full, selective
ALLOW_BUSY = os.environ.get("VPIPE_ASV_ALLOW_BUSY", "") not in ("", "0")
BUSY = "host busy"


def busy_host(host_rounds: list[dict[str, Any]]) -> str | None:
    """Why the sweep's figures cannot stand for this commit, when other processes kept more
    of the CPU busy than :data:`vpipe.trace.host_state.LIMITS` allows (under a busy core the
    normalised step came out 0.89x, a false "PERFORMANCE INCREASED"); None on a quiet host."""
    from vpipe.trace.host_state import LIMITS, summarise

    other = summarise(host_rounds).get("other_cores")
    if other is None or other <= LIMITS["other_cores"]:
        return None
    return (
        f"other processes kept {other:.2f} cores busy during the sweep (limit "
        f"{LIMITS['other_cores']}): no timing recorded; VPIPE_ASV_ALLOW_BUSY=1 records it anyway"
    )


def tracked() -> list[Metric]:
    """The registry's metrics the suite tracks."""
    return [m for m in registry() if m.asv is not None]


def make_tracks() -> dict[str, Callable[..., Any]]:
    """``track_<name>`` methods, with their units, of the tracked metrics."""
    return {f"track_{m.asv.name}": _track(m) for m in tracked()}


def samples(values: list[float]) -> dict[str, Any]:
    """A track's figures in the form asv keeps samples of (its timing benchmarks' result), so
    that rounds add up instead of the last one replacing the others."""
    return {"samples": values, "number": 1}


def first_reading(key: str) -> bool:
    """Whether this is the first time ``key`` is read from this round's cache (asv runs the
    benchmarks in its cache directory): without interleaving, every round reads the same
    launch, which must count once."""
    import hashlib
    from pathlib import Path

    marker = Path(f"read-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if marker.exists():
        return False
    marker.touch()
    return True


def _track(metric: Metric) -> Callable[..., Any]:
    name = metric.asv.name

    def track(self: Any, cache: dict, schedule: str, microbatches: int) -> Any:
        key = f"{name}/{schedule}/{microbatches}"
        if BUSY in cache and metric.asv.host_bound:
            import sys

            print(f"no sample this round: {cache[BUSY]}", file=sys.stderr)
            return samples([])
        if not first_reading(key):
            return samples([])
        return samples([cache[f"{schedule}/{microbatches}"][name]])

    track.__name__ = track.__qualname__ = f"track_{name}"
    track.unit = metric.asv.unit
    return track


def _with_tracks(cls: type) -> type:
    for name, method in make_tracks().items():
        setattr(cls, name, method)
    return cls


@_with_tracks
class PipelineCPU:
    """2 ranks, gloo, MLP (d_model 512, d_hidden 2048), batch 128, vpipe runtime."""

    params = (SCHEDULES, MICROBATCHES)
    param_names = ("schedule", "microbatches")
    timeout = 600

    def setup_cache(self) -> dict:
        from vpipe.sweep.blocks import run_blocks
        from vpipe.sweep.driver import SweepSpec
        from vpipe.sweep.results import collect

        spec = SweepSpec(
            ranks=RANKS,
            model="mlp",
            sizes=SIZES,
            batch=BATCH,
            schedules=tuple(SCHEDULES),
            microbatches=tuple(MICROBATCHES),
            impls=("vpipe",),
            warmup=2,
            steps=4,
            rounds=5,  # 20 timed steps per config per launch (vpipe bench's rounds)
            profile=False,  # no tracked figure needs a trace
            progress=False,
            blocks=BLOCKS,
            inject_delay_ms=INJECT_DELAY_MS,
            dtype=DTYPE,
            recompute=RECOMPUTE,
        )
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            spec.trace_dir = tmp
            res = collect(spec, run_blocks(spec, "asv"), "asv", 0.0, simulate=False)
        busy = None if ALLOW_BUSY else busy_host(res.host.to_dict("records"))
        return ({BUSY: busy} if busy else {}) | {
            f"{row['schedule']}/{int(row['microbatches'])}": {
                m.asv.name: m.asv.value(row[m.name]) for m in tracked()
            }
            for row in res.measured.to_dict("records")
        }

    setup_cache.timeout = 600
