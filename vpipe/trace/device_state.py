"""The GPU's state while a sweep runs, and whether two runs' devices differed.

On ``--device cuda`` the step is what the GPU did (CUDA events), so whether two runs can be
compared depends on the device, not on the host's CPU: each round times a fixed matrix product
on the GPU with CUDA events (:class:`vpipe.sweep.reference.DeviceReference`) and reads, through
NVML (``nvidia-ml-py``, imported only when a sweep runs on a GPU, optional: without it only the
device reference is judged), the SM and memory clocks, the temperature, the power draw and the
clock-event ("throttle") reasons. :func:`judge_devices` compares two runs' summaries and says
in words what differed; on GPUs the comparison's "device differed" rests on it, and the CPU's
state and reference only describe the host side.

The limits (:data:`DEVICE_LIMITS`) are first settings, not yet measured on a GPU:
``python -m bench.device_reference`` on a GPU host prints the figures to set them from (the
device reference's spread within and between launches, and the NVML readings).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

# NVML's clock-event reasons (nvmlClocksEventReason*): the bits that mean the GPU ran slower
# than it could for a reason outside the workload; idle and application-clock settings are not
THROTTLE_BITS = {
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
}
DEVICE_LIMITS = {
    "sm_mhz_ratio": 1.02,  # SM clock 2% apart: the step's compute scales with it
    "mem_mhz_ratio": 1.02,
    "temp_c": 15.0,  # degrees apart: clocks follow temperature near the limits
    "device_ref_floor": 0.02,  # the device reference 2% apart at least (log), or more ...
    "device_ref_z": 3.0,  # ... when its own spread within the runs says so
}
SUMMARY = ("sm_mhz", "mem_mhz", "temp_c", "power_w", "device_ref_s")


def throttle_reasons(mask: int | None) -> list[str]:
    """The slowdown reasons set in an NVML clock-event mask, in words."""
    if not mask:
        return []
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]


def nvml() -> Any | None:
    """The ``pynvml`` module (nvidia-ml-py), initialised; None where it is not installed or
    finds no driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_*: no driver, no device
        return None
    return pynvml


def sample(index: int, lib: Any | None = None) -> dict[str, Any]:
    """This moment's state of GPU ``index`` through NVML (``lib``: the pynvml module, or a
    stand-in with the same functions); empty without NVML. A reading NVML refuses is None."""
    lib = lib if lib is not None else nvml()
    if lib is None:
        return {}
    handle = lib.nvmlDeviceGetHandleByIndex(index)

    def read(fn: str, *args: Any) -> Any:
        try:
            return getattr(lib, fn)(handle, *args)
        except Exception:  # NVMLError_NotSupported and friends
            return None

    reasons_fn = (
        "nvmlDeviceGetCurrentClocksEventReasons"
        if hasattr(lib, "nvmlDeviceGetCurrentClocksEventReasons")
        else "nvmlDeviceGetCurrentClocksThrottleReasons"
    )
    power = read("nvmlDeviceGetPowerUsage")
    return {
        "sm_mhz": read("nvmlDeviceGetClockInfo", getattr(lib, "NVML_CLOCK_SM", 1)),
        "mem_mhz": read("nvmlDeviceGetClockInfo", getattr(lib, "NVML_CLOCK_MEM", 2)),
        "temp_c": read("nvmlDeviceGetTemperature", getattr(lib, "NVML_TEMPERATURE_GPU", 0)),
        "power_w": None if power is None else power / 1000,
        "throttle": read(reasons_fn),
    }


def summarise(rounds: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A run's device state: the median of each figure of :data:`SUMMARY` over its rounds,
    the log sd of its device reference over them and their count, and every slowdown reason
    seen; empty when no round was read on a GPU."""
    rows = [r for r in rounds if r.get("device_ref_s") is not None or r.get("sm_mhz") is not None]
    if not rows:
        return {}
    out: dict[str, Any] = {}
    for key in SUMMARY:
        values = [float(r[key]) for r in rows if r.get(key) is not None and r[key] == r[key]]
        out[key] = float(np.median(values)) if values else None
    refs = [float(r["device_ref_s"]) for r in rows if (r.get("device_ref_s") or 0) > 0]
    out["device_ref_sd"] = float(np.std(np.log(refs), ddof=1)) if len(refs) >= 2 else None
    out["device_ref_n"] = len(refs)
    masks = [int(r["throttle"]) for r in rows if r.get("throttle") is not None and r["throttle"] == r["throttle"]]
    out["throttle"] = sorted({name for m in masks for name in throttle_reasons(m)})
    return out


def reference_limit(a: Mapping[str, Any], b: Mapping[str, Any], floor: float, z: float) -> float:
    """How far apart (log) two runs' reference medians may be before the device (or host)
    counts as different: ``z`` x the sd of the difference of two medians from each run's own
    spread over its rounds (sd x 1.2533 / sqrt(n)), at least ``floor``."""
    var = 0.0
    for s in (a, b):
        sd, n = s.get("device_ref_sd"), s.get("device_ref_n") or 0
        if sd is not None and n >= 2:
            var += (1.2533 * sd) ** 2 / n
    return max(floor, z * math.sqrt(var))


def judge_devices(
    a: Mapping[str, Any], b: Mapping[str, Any], limits: Mapping[str, float] = DEVICE_LIMITS
) -> list[str]:
    """What differed between two runs' device summaries (:func:`summarise`), in words with the
    figures; empty when nothing did or nothing was recorded."""
    out = []
    for key, words in (("sm_mhz", "SM clock"), ("mem_mhz", "memory clock")):
        x, y = a.get(key), b.get(key)
        if x and y and max(x / y, y / x) > limits[f"{key}_ratio"]:
            out.append(f"{words} {x:.0f} vs {y:.0f} MHz")
    ta, tb = a.get("temp_c"), b.get("temp_c")
    if ta is not None and tb is not None and abs(ta - tb) > limits["temp_c"]:
        out.append(f"GPU temperature {ta:.0f} vs {tb:.0f} C")
    ra, rb = set(a.get("throttle") or ()), set(b.get("throttle") or ())
    if ra != rb:
        out.append(f"slowdown reasons {', '.join(sorted(ra)) or 'none'} vs {', '.join(sorted(rb)) or 'none'}")
    x, y = a.get("device_ref_s"), b.get("device_ref_s")
    if x and y:
        limit = reference_limit(a, b, limits["device_ref_floor"], limits["device_ref_z"])
        if abs(math.log(x / y)) > limit:
            out.append(f"device reference {x * 1e3:.3f} vs {y * 1e3:.3f} ms (limit {math.expm1(limit):.1%})")
    return out
