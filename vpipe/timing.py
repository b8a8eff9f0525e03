"""Wall time of one call on the device it runs on: host clock on CPUs, CUDA events on GPUs.

On a GPU the host returns from a step long before its kernels finish, and reading the host
clock after a synchronise adds the host's own scheduling jitter to every figure; a pair of
``torch.cuda.Event(enable_timing=True)`` recorded on the current stream around the call and
read after a device synchronise measures the GPU's timeline instead. Importing this module does
not import torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def step_seconds(fn: Callable[[], object], device: Any) -> float:
    """Seconds ``fn()`` takes on ``device`` (a ``torch.device``): CUDA events on a GPU, the
    host's perf_counter otherwise."""
    if getattr(device, "type", None) == "cuda":
        return cuda_event_seconds(fn, device)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cuda_event_seconds(fn: Callable[[], object], device: Any) -> float:
    """Seconds between CUDA events recorded on the current stream before and after ``fn()``,
    read once ``device`` has finished all its work (so the step's kernels are included)."""
    import torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
