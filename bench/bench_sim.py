"""asv benchmarks of the pure-Python schedule tools on a large schedule: zbv at P=64, M=1024
(393k compute actions; 909k actions once lowered). Goal: ``simulate`` in under 2 s.

The timer is the process's CPU time (``time.process_time``), not the wall clock: these calls
are single-process and compute-only, so their CPU time is what the code costs, and another job
on the host barely moves it (zbv P=64 M=1024 ``simulate`` under a load of 5.5 on 2 cores: wall
1.6-5.1 s, CPU 0.37-0.38 s), where seconds of wall time made ``asv continuous`` report the same
code 1.5x slower. Seven repeats give asv's Mann-Whitney test enough samples to judge a change.
``python -m bench.bench_sim`` prints both clocks.
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


class ZBV64x1024:
    """simulate / lower / validate of zbv, P=64, M=1024, in CPU seconds."""

    timer = time.process_time
    number = 1
    repeat = 7
    rounds = 1
    warmup_time = 0
    timeout = 600

    def setup(self) -> None:
        self.schedule = _schedule()
        self.lowered = _lowered()

    def time_simulate(self) -> None:
        """Compute-only input: validates, plans the communication, replays."""
        from vpipe import simulate

        simulate(self.schedule)

    def time_simulate_lowered(self) -> None:
        from vpipe import simulate

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
    for name in sorted(n for n in dir(bench) if n.startswith("time_")):
        wall, cpu = _clocks(getattr(bench, name), 3)
        print(f"{name[5:]:>18}: median {wall:.3f} s wall, {cpu:.3f} s CPU")


if __name__ == "__main__":
    main()
