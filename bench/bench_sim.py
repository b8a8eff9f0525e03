"""asv benchmarks of the pure-Python schedule tools on a large schedule: zbv at P=64, M=1024
(393k compute actions; 909k actions once lowered). Goal: ``simulate`` in under 2 s.

``python -m bench.bench_sim`` prints the median of 3 runs of each benchmark.
"""

from __future__ import annotations

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


class ZBV64x1024:
    """simulate / lower / validate of zbv, P=64, M=1024."""

    number = 1
    repeat = 3
    rounds = 1
    warmup_time = 0
    timeout = 600

    def setup(self) -> None:
        self.schedule = _schedule()
        self.lowered = _lowered()

    def time_simulate(self) -> None:
        """Compute-only input: validates, plans the communication, replays."""
        from vpipe.sim import simulate

        simulate(self.schedule)

    def time_simulate_lowered(self) -> None:
        from vpipe.sim import simulate

        simulate(self.lowered)

    def time_lower(self) -> None:
        """Validates the input, then inserts SEND/RECV."""
        from vpipe import lower

        lower(self.schedule)

    def time_lower_unchecked(self) -> None:
        from vpipe import lower

        lower(self.schedule, check=False)

    def time_validate(self) -> None:
        from vpipe import validate

        validate(self.schedule)

    def time_validate_lowered(self) -> None:
        from vpipe import validate

        validate(self.lowered)


def main() -> None:
    """Print the median of 3 runs of every benchmark (wall clock, seconds)."""
    import statistics
    import time

    bench = ZBV64x1024()
    bench.setup()
    print(
        f"{SCHEDULE} P={RANKS} M={MICROBATCHES}: {bench.schedule.n_compute_actions()} compute "
        f"actions, {sum(map(len, bench.lowered.actions))} actions lowered"
    )
    for name in sorted(n for n in dir(bench) if n.startswith("time_")):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            getattr(bench, name)()
            times.append(time.perf_counter() - t0)
        spread = f"{min(times):.3f}-{max(times):.3f}"
        print(f"{name[5:]:>18}: median {statistics.median(times):.3f} s  (range {spread})")


if __name__ == "__main__":
    main()
