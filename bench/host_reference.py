"""Figures of the asv suite that survive a changing host: a call timed alternately with a fixed
reference workload, reported as the ratio of their fastest timings.

asv compares one figure per benchmark between two commits (``asv continuous`` flags a ratio
above its factor, 1.1 by default). Seconds measured an hour apart on a shared host differ by
more than that when another job comes or goes: the same code was reported 1.5-1.9x slower.
Timing the benchmarked call and a reference that no commit changes in alternation makes both
slow down together, so their ratio moves with the code, not with the host. This module is part
of the benchmark suite, not of vpipe: asv runs the suite of the checkout against every commit it
builds, so it must not depend on the vpipe version installed.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def python_reference(n: int = 1_000_000) -> int:
    """A fixed pure-Python workload (integer arithmetic, dict stores, a sort), about 0.1 s:
    the reference for vpipe's pure-Python code (simulator, lowering, validation). Returns a
    checksum so the work cannot be skipped."""
    table: dict[int, int] = {}
    acc = 0
    for i in range(n):
        acc = (acc * 31 + i) % 1_000_003
        table[i & 1023] = acc
    return acc + sum(sorted(table.values())[:16])


def interleaved_best(
    fn: Callable[[], object], reference: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """The fastest of ``repeats`` timings of ``fn()`` and of ``reference()``, timed alternately
    (reference first). Both are deterministic single-threaded code, so their fastest run is
    the least disturbed one (another process takes time away; it never gives any): the ratio
    of the two minima shrugs off bursts of load that hit some repeats, and a host that stays
    slower slows both alike."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    ours: list[float] = []
    refs: list[float] = []
    for _ in range(repeats):
        for call, out in ((reference, refs), (fn, ours)):
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
    return min(ours), min(refs)
