"""How a rank's process gets host memory back after freeing it: ``--cpu-allocator``.

On a GPU, torch's caching allocator keeps the blocks a step frees and hands them to the next
step. On the CPU, torch asks the C library's ``malloc`` for every tensor, and glibc's defaults
give memory back to the kernel as it is freed: buffers above its mmap threshold are unmapped
on free, and the top of the heap is trimmed once more than its trim threshold is free. The
next step then takes the same memory again one page fault per 4 KiB page, zeroed by the
kernel. A fused backward of one stage of the benchmark MLP (2 blocks 384 -> 1536, 64 rows,
one thread) took about 1,100 page faults per call and 12.3 and 11.9 ms in two runs, against
none and 9.7 and 10.0 ms with the memory kept (docs/runtime.md). How many it takes depends
on what else is on the heap, so the cost differs between schedules and between launches.

``cached`` (the default) sets glibc's thresholds so that freed memory stays in the process,
as on a GPU: no trimming, and no mmap below :data:`MMAP_THRESHOLD_BYTES`. Resident memory
then stays at its peak, as a caching allocator's reserved memory does. ``system`` keeps the
C library's defaults. Outside glibc (macOS, musl) there is nothing to set: the run records
``system``.
"""

from __future__ import annotations

import ctypes
from typing import Literal

CPU_ALLOCATORS = ("cached", "system")  # the first is the default

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit hosts (HEAP_MAX_SIZE / 2): larger buffers
# are still mapped and unmapped, as the caching allocator also gives huge blocks their own
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# trim the heap only past 2 GiB free at its top (mallopt takes an int): never, in practice
_TRIM_THRESHOLD_BYTES = 2**31 - 1


def apply_cpu_allocator(choice: str) -> Literal["cached", "system"]:
    """Set this process's ``malloc`` as ``choice`` asks (see the module's doc); returns what
    is in effect: ``system`` where the C library is not glibc or refuses the setting."""
    if choice not in CPU_ALLOCATORS:
        raise ValueError(
            f"unknown --cpu-allocator {choice!r}: choose from {', '.join(CPU_ALLOCATORS)}"
        )
    if choice == "system":
        return "system"
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return "system"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    kept = kept and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    return "cached" if kept else "system"
