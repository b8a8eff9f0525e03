"""--cpu-allocator: a rank's malloc keeps freed memory (cached) or follows the C library's
defaults (system); with cached, a step's churn of large tensors stops costing page faults."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vpipe.runtime.host_memory import apply_cpu_allocator

# A fresh process without torch: a 24 MiB buffer malloc'd, written and freed, three times;
# the page faults of each. With glibc's defaults the first is mapped and unmapped on free,
# which raises the mmap threshold, so the second comes from the heap, grown for it: both fault
# it in whole. With cached the first grows the heap and the rest reuse it. (Loops of torch
# tensors are not used: whether glibc reuses or trims their memory depends on where the heap
# lands and on what sits beside a freed buffer, and the defaults faulted 0 or 20,000 pages
# from one launch to the next.)
CHURN = """
import ctypes, json, resource, sys
from vpipe.runtime.host_memory import apply_cpu_allocator
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
in_effect = apply_cpu_allocator(sys.argv[1])
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(24 * 2**20)
    ctypes.memset(p, 1, 24 * 2**20)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([in_effect, faults]))
"""


def _churn(choice: str) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", CHURN, choice], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    in_effect, faults = json.loads(out.stdout.strip().splitlines()[-1])
    return in_effect, faults


def test_cached_keeps_freed_memory_so_the_next_buffer_takes_no_page_faults():
    system, system_faults = _churn("system")
    cached, cached_faults = _churn("cached")
    assert (system, cached) == ("system", "cached")  # this host's C library is glibc
    pages = 24 * 2**20 // 4096  # 6,144
    assert system_faults[1] > 0.8 * pages  # the defaults fault the second buffer in whole
    assert cached_faults[0] > 0.8 * pages and max(cached_faults[1:]) < 200


def test_an_unknown_allocator_is_refused_by_name():
    with pytest.raises(ValueError, match="'jemalloc': choose from cached, system"):
        apply_cpu_allocator("jemalloc")
