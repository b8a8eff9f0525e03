"""A host-speed reference: a short fixed workload timed before every timed step on every rank.

Step times from two runs differ for two reasons: the code, and the host (other jobs, CPU
frequency, steal). The reference is a matmul and a copy sized like one pipeline action
(a microbatch's rows through the model's first linear layer, forward and a backward-like
transposed product) that no commit changes. Timed in the same rounds as the steps, its time
tracks how fast the host was right then, so a step time over its reference time is a figure
comparable across runs (:mod:`vpipe.report.crossrun`). Its shape is recorded with the sweep; runs
with different shapes are not normalised against each other. Importing this module does not
import torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# Floating-point work per timing (about 10-20 ms on one CPU core): long enough to span several
# of the OS scheduler's time slices, so that a process competing for the core slows the
# reference as it slows a step. A short one (under a millisecond) starts right after a barrier,
# where the scheduler favours the woken rank over a CPU hog, and did not slow at all.
TARGET_FLOPS = 2e8
MIN_REPEATS = 4
# A tiny shape never reaches TARGET_FLOPS in reasonable time: its products are launch-bound
# (about 3.4 us a repeat on one core of a 2-core CPU host, measured 2026-12-05 for rows 2,
# 16 x 32), so the repeats stop here, about 14 ms of work, instead of 164 ms at 48829 repeats.
MAX_REPEATS = 4096


def reference_shape(sizes: Mapping[str, int], batch: int, microbatches: int) -> dict[str, int]:
    """The reference's shape for a sweep: one microbatch's rows (of the largest microbatch
    count's), the model's width and hidden width (defaults where the model has none), and as
    many repeats as make :data:`TARGET_FLOPS`, at most :data:`MAX_REPEATS` (fixed by the
    shape, so every run of the same sweep does the same work)."""
    d_in = int(sizes.get("d_model", 256))
    d_out = int(sizes.get("d_hidden", 4 * d_in))
    rows = max(batch // max(microbatches, 1), 1)
    repeats = math.ceil(TARGET_FLOPS / (4 * rows * d_in * d_out))
    repeats = min(max(MIN_REPEATS, repeats), MAX_REPEATS)
    return {"rows": rows, "d_in": d_in, "d_out": d_out, "repeats": repeats}


class Reference:
    """The reference workload on one device, its tensors allocated once."""

    def __init__(self, shape: Mapping[str, int], device: Any, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        rows, d_in, d_out = shape["rows"], shape["d_in"], shape["d_out"]
        self.repeats = shape["repeats"]
        self.device = device
        self.x = torch.randn(rows, d_in, generator=g).to(device)
        self.w = torch.randn(d_in, d_out, generator=g).to(device)
        self.h = torch.empty(rows, d_out, device=device)
        self.back = torch.empty(rows, d_in, device=device)

    def run(self) -> None:
        """One timing's work: per repeat, forward product, copy, transposed product."""
        import torch

        for _ in range(self.repeats):
            y = self.x @ self.w
            self.h.copy_(y)
            torch.matmul(self.h, self.w.t(), out=self.back)

    def timed(self) -> float:
        """Seconds of :meth:`run` on this rank, started together with every rank (barrier),
        as a timed step is (:meth:`vpipe.sweep.harness.RankHarness.timed_step`)."""
        import torch.distributed as dist

        from vpipe.timing import step_seconds

        dist.barrier()
        return step_seconds(self.run, self.device)


# The device reference on GPUs: a fixed matrix product, the same on every GPU and every sweep
# (not sized like the model: it measures the device, not the workload), timed with CUDA events
# once per round. 4096^3 x 2 flops x 4 products: about 9 ms in fp32 on an H200, far above the
# microseconds of launch overhead, short enough to add little to a round.
DEVICE_SHAPE = {"n": 4096, "repeats": 4}


class DeviceReference:
    """The device reference on one GPU: :data:`DEVICE_SHAPE`'s products, timed with CUDA
    events (:func:`vpipe.timing.cuda_event_seconds`), so the figure is the GPU's own time."""

    def __init__(self, device: Any, shape: Mapping[str, int] = DEVICE_SHAPE, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        n = shape["n"]
        self.repeats = shape["repeats"]
        self.device = device
        self.a = torch.randn(n, n, generator=g).to(device)
        self.b = torch.randn(n, n, generator=g).to(device)
        self.out = torch.empty(n, n, device=device)

    def run(self) -> None:
        import torch

        for _ in range(self.repeats):
            torch.matmul(self.a, self.b, out=self.out)

    def timed(self) -> float:
        """Seconds of :meth:`run` on the GPU (CUDA events, after a synchronise)."""
        from vpipe.timing import cuda_event_seconds

        return cuda_event_seconds(self.run, self.device)


def device_round(reference: DeviceReference | None, device: Any) -> dict[str, Any]:
    """One round's device figures on a GPU: the device reference's time and NVML's readings
    (:func:`vpipe.trace.device_state.sample`); empty on a CPU."""
    if reference is None:
        return {}
    from vpipe.trace.device_state import sample

    return {"device_ref_s": reference.timed(), **sample(nvml_index(device))}


def nvml_index(device: Any) -> int:
    """NVML's index of a CUDA device (CUDA_VISIBLE_DEVICES renumbers CUDA's, not NVML's)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    to_nvml = getattr(torch.cuda, "_get_nvml_device_index", None)
    try:
        return int(to_nvml(index)) if to_nvml else index
    except Exception:  # no NVML there: CUDA's own index
        return index
