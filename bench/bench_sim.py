"""asv benchmarks of the pure-Python schedule tools on a large schedule: zbv at P=64, M=1024
(393k compute actions; 909k actions once lowered). Goal: ``simulate`` in under 2 s.

Each benchmark is a ``track_`` figure: the call's fastest time over a fixed pure-Python
reference's (:mod:`bench.host_reference`), the two timed alternately, so that ``asv continuous``
across a busy and a quiet hour compares the code, not the host. ``python -m bench.bench_sim``
prints the seconds and the normalised figures.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from bench.host_reference import interleaved_best, python_reference

RANKS, MICROBATCHES, SCHEDULE = 64, 1024, "zbv"
REPEATS = 5  # alternations per figure: the fastest of 5 is rarely disturbed


@lru_cache(maxsize=1)
def _schedule():
    from vpipe.schedules import make_schedule

    return make_schedule(SCHEDULE, RANKS, MICROBATCHES)


@lru_cache(maxsize=1)
def _lowered():
    from vpipe import lower

    return lower(_schedule(), check=False)


def operations() -> dict[str, Callable[[], object]]:
    """The benchmarked calls, by name."""
    from vpipe import lower, simulate, validate

    schedule, lowered = _schedule(), _lowered()
    return {
        # compute-only input: validates, plans the communication, replays
        "simulate": lambda: simulate(schedule),
        "simulate_lowered": lambda: simulate(lowered),
        # validates the input, then inserts SEND/RECV
        "lower": lambda: lower(schedule),
        "lower_unchecked": lambda: lower(schedule, check=False),
        "validate": lambda: validate(schedule),
        "validate_lowered": lambda: validate(lowered),
    }


def _track(name: str) -> Callable[..., float]:
    def track(self: ZBV64x1024) -> float:
        ours, ref = interleaved_best(operations()[name], python_reference, REPEATS)
        return ours / ref

    track.__name__ = f"track_{name}"
    track.unit = "reference units"
    return track


class ZBV64x1024:
    """simulate / lower / validate of zbv, P=64, M=1024, in units of the host reference."""

    timeout = 600

    def setup(self) -> None:
        _schedule()
        _lowered()


OPERATIONS = ("simulate", "simulate_lowered", "lower", "lower_unchecked", "validate", "validate_lowered")
for _name in OPERATIONS:
    setattr(ZBV64x1024, f"track_{_name}", _track(_name))


def main() -> None:
    """Print each benchmark's fastest seconds and its figure in reference units."""
    bench = ZBV64x1024()
    bench.setup()
    print(
        f"{SCHEDULE} P={RANKS} M={MICROBATCHES}: {_schedule().n_compute_actions()} compute "
        f"actions, {sum(map(len, _lowered().actions))} actions lowered"
    )
    for name, call in operations().items():
        ours, ref = interleaved_best(call, python_reference, REPEATS)
        print(f"{name:>18}: fastest {ours:.3f} s, reference {ref:.3f} s, {ours / ref:.2f} units")


if __name__ == "__main__":
    main()
