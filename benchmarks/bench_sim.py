"""asv benchmarks of the pure-Python schedule tools on a large schedule: zbv at P=64, M=1024
(393k compute actions; 909k actions once lowered). Goal: ``simulate`` in under 2 s.

Each benchmark tracks its CPU seconds over those of a fixed reference workload (Python dicts
and lists, a numpy sort and cumulative sum: what the simulator's own work is made of), timed
alternately with it in the same process, the median of :data:`REPEATS` of each (one sample
per asv round, as in benchmarks.py): a figure in
reference units that a host slower for the moment (another job sharing the core or its cache,
a lower clock) leaves unchanged. CPU time alone was not enough: with one core kept busy,
``asv continuous`` reported the same code's ``lower`` 1.19x slower (204 vs 243 ms of CPU), and
before that wall time made it report ``simulate`` 1.5x slower. ``python -m benchmarks.bench_sim``
prints the absolute wall and CPU seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache

RANKS, MICROBATCHES, SCHEDULE = 64, 1024, "zbv"


@lru_cache(maxsize=1)
def _schedule():
    from vpipe.schedules import make_schedule

    return make_schedule(SCHEDULE, RANKS, MICROBATCHES)


@lru_cache(maxsize=1)
def _lowered():
    from vpipe import lower

    return lower(_schedule(), check=False)


REPEATS = 5
# asv prints only seconds and bytes with their unit: the benchmarks' names carry this one
UNIT = "CPU reference units"


def reference_work() -> None:
    """The fixed workload the benchmarks are measured in: about 30 ms of CPU."""
    import numpy as np

    counts: dict[int, int] = {}
    for i in range(300_000):
        counts[i % 1000] = counts.get(i % 1000, 0) + i
    doubled = [x * 2 for x in range(200_000)]
    values = np.random.default_rng(0).random(400_000)
    np.sort(values)
    np.cumsum(values)
    del doubled


def normalised_cpu(call: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median CPU seconds of ``call`` over the median CPU seconds of :func:`reference_work`,
    the two timed alternately (reference first and last), each with the garbage collector off
    after a full collection, as timeit does: ``lower`` allocates about a million objects, and
    whether a full collection of the benchmark's large heap falls inside it moved its figure
    1.32x between two processes of the same code."""
    import gc
    import statistics

    def cpu(f: Callable[[], object]) -> float:
        gc.collect()
        gc.disable()
        try:
            start = time.process_time()
            f()
            return time.process_time() - start
        finally:
            gc.enable()

    ops, refs = [], [cpu(reference_work)]
    for _ in range(repeats):
        ops.append(cpu(call))
        refs.append(cpu(reference_work))
    return statistics.median(ops) / statistics.median(refs)


class ZBV64x1024:
    """simulate / lower / validate of zbv, P=64, M=1024, in reference units of CPU time."""

    timeout = 600

    def setup(self) -> None:
        self.schedule = _schedule()
        self.lowered = _lowered()

    def simulate(self) -> None:
        """Compute-only input: validates, plans the communication, replays."""
        from vpipe import simulate

        simulate(self.schedule)

    def simulate_lowered(self) -> None:
        from vpipe import simulate

        simulate(self.lowered)

    def lower(self) -> None:
        """Validates the input, then inserts SEND/RECV."""
        from vpipe import lower

        lower(self.schedule)

    def lower_unchecked(self) -> None:
        from vpipe import lower

        lower(self.schedule, check=False)

    def validate(self) -> None:
        from vpipe import validate

        validate(self.schedule)

    def validate_lowered(self) -> None:
        from vpipe import validate

        validate(self.lowered)


OPERATIONS = ("simulate", "simulate_lowered", "lower", "lower_unchecked", "validate",
              "validate_lowered")  # fmt: skip


def _track(operation: str) -> Callable[[ZBV64x1024], dict]:
    def track(self: ZBV64x1024) -> dict:
        # one sample per round, as asv's timing benchmarks give theirs (benchmarks.py's doc)
        return {"samples": [normalised_cpu(getattr(self, operation))], "number": 1}

    track.__name__ = track.__qualname__ = f"track_{operation}_in_ref_units"
    track.unit = UNIT  # type: ignore[attr-defined]
    return track


for _operation in OPERATIONS:
    setattr(ZBV64x1024, f"track_{_operation}_in_ref_units", _track(_operation))


def _clocks(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``repeats`` calls."""
    import statistics

    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        call()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    """Print the median wall and CPU seconds of 3 runs of every benchmark."""
    bench = ZBV64x1024()
    bench.setup()
    print(
        f"{SCHEDULE} P={RANKS} M={MICROBATCHES}: {bench.schedule.n_compute_actions()} compute "
        f"actions, {sum(map(len, bench.lowered.actions))} actions lowered"
    )
    for name in OPERATIONS:
        wall, cpu = _clocks(getattr(bench, name), 3)
        units = normalised_cpu(getattr(bench, name), 3)
        print(f"{name:>18}: median {wall:.3f} s wall, {cpu:.3f} s CPU, {units:.2f} reference units")


if __name__ == "__main__":
    main()
