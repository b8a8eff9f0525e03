"""--cpu-allocator: a rank's malloc keeps freed memory (cached) or follows the C library's
defaults (system); with cached, a step's churn of large tensors stops costing page faults."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

from vpipe.runtime.host_memory import apply_cpu_allocator

# A fresh process: a step's tensors (200 of 100 KiB, below glibc's first mmap threshold, so
# all on the heap) allocated and written, then all freed at its end; the page faults of four
# steps after two that grow the heap. Address-space randomisation is off in it: with it on,
# where the heap lands decides whether glibc can trim its top at all, and the C library's
# defaults then fault 0 or about 20,000 pages from one run to the next.
CHURN = """
import json, resource, sys, torch
from vpipe.runtime.host_memory import apply_cpu_allocator
torch.set_num_threads(1)
in_effect = apply_cpu_allocator(sys.argv[1])
def step():
    held = [torch.empty(25 * 1024).fill_(1.0) for _ in range(200)]
    del held
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(json.dumps([in_effect, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before]))
"""
ADDR_NO_RANDOMIZE = 0x0040000  # personality(2)
_personality = ctypes.CDLL(None).personality  # looked up here: the child only calls it


def _no_aslr() -> None:
    _personality(ADDR_NO_RANDOMIZE)


def _churn(choice: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, choice], capture_output=True, text=True,
                         timeout=120, check=True, preexec_fn=_no_aslr)  # fmt: skip
    in_effect, faults = json.loads(out.stdout.strip().splitlines()[-1])
    return in_effect, faults


def test_cached_keeps_freed_memory_so_repeated_steps_take_no_page_faults():
    system, system_faults = _churn("system")
    cached, cached_faults = _churn("cached")
    assert (system, cached) == ("system", "cached")  # this host's C library is glibc
    # system: glibc trims the freed top of the heap after each step, and the next step faults
    # the same 20 MiB in again (about 4,900 pages a step on this host); cached keeps it
    assert system_faults > 4 * 4000
    assert cached_faults < 200


def test_an_unknown_allocator_is_refused_by_name():
    with pytest.raises(ValueError, match="'jemalloc': choose from cached, system"):
        apply_cpu_allocator("jemalloc")
