"""The host's state while a sweep runs, read from /proc, and whether two runs' hosts differed.

A step time measured on a shared host depends on what else the host did meanwhile. Each
timed round samples, before and after: the 1-minute load average (``/proc/loadavg``), the
machine's busy and steal jiffies (``/proc/stat``), the CPU MHz (``/proc/cpuinfo`` or cpufreq,
where readable) and the CPU seconds the sweep's own rank processes used. From two samples a
round's state (:func:`round_state`): how many cores other processes kept busy (machine busy
time minus the sweep's own, per wall second), the steal share, the load and the MHz.

:func:`judge_hosts` compares two runs' summaries (:func:`summarise`) against fixed limits
(:data:`LIMITS`) and says in words what differed; a cross-run verdict that would call a
difference faster or slower becomes "host differed" when it does. Parsing is pure (text in,
numbers out) so it is tested on made-up /proc contents; :func:`sample` does the reading.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# When two runs' hosts differ enough that normalising by the reference cannot be trusted:
# other processes' CPU (in cores), steal share, CPU MHz ratio and reference-time ratio.
LIMITS = {
    "other_cores": 0.5,  # half a core of someone else's work between the runs
    "steal": 0.05,  # 5 points of stolen CPU time
    "mhz_ratio": 1.10,  # clock frequency 10% apart
    # the reference workload's time at least 10% apart, and beyond what quiet runs show
    # (reference_limit: its measured spread between runs is an input, not this constant)
    "ref_ratio": 1.10,
    # cores the others left free, 25% apart: when the host is saturated another job's extra
    # load barely raises "other_cores" (there is no idle CPU left to take), yet it takes a
    # share from the sweep (1.08 vs 1.49 other cores is 0.92 vs 0.51 left on 2 cores)
    "free_ratio": 1.25,
}
FREE_FLOOR = 0.1  # cores: below this a run had next to nothing, whatever the figure
# The reference's own spread between quiet runs: the log sd of a one-block run's median
# reference time as a comparison with the next run sees it, measured by python -m
# bench.back_to_back on this 2-core host (docs/comparing.md): 0.044 from 10 back-to-back pairs
# of quiet runs (ratios median 5.0%, max 11.0%; an earlier 3-minute sample read 0.019, too
# few to show the process-to-process part). A run with several blocks measures its own (its
# blocks' medians); the larger counts.
REF_RUN_SD = 0.044
REF_Z = 2.576  # two runs' references farther apart than 99% of quiet pairs: the host differed


def parse_loadavg(text: str) -> float:
    """The 1-minute load average of ``/proc/loadavg``'s text."""
    return float(text.split()[0])


def parse_proc_stat(text: str) -> dict[str, int]:
    """Jiffies of the aggregate ``cpu`` line of ``/proc/stat``: busy (all but idle, iowait and
    steal), steal, and total; plus the number of ``cpuN`` lines (cores)."""
    cores, fields = 0, None
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if head == "cpu":
            fields = [int(x) for x in line.split()[1:]]
        elif head.startswith("cpu") and head[3:].isdigit():
            cores += 1
    if fields is None:
        raise ValueError("no aggregate 'cpu' line in /proc/stat")
    fields += [0] * (8 - len(fields))
    # user nice system idle iowait irq softirq steal [guest guest_nice: counted in user]
    idle, iowait, steal = fields[3], fields[4], fields[7]
    total = sum(fields[:8])
    return {"busy": total - idle - iowait - steal, "steal": steal, "total": total, "cores": cores}


def parse_cpu_mhz(cpuinfo: str) -> float | None:
    """The mean ``cpu MHz`` of ``/proc/cpuinfo``'s text; None when it has none."""
    values = [
        float(line.split(":", 1)[1])
        for line in cpuinfo.splitlines()
        if line.lower().startswith("cpu mhz") and ":" in line
    ]
    return float(np.mean(values)) if values else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def read_mhz() -> float | None:
    """The CPUs' current mean MHz: cpufreq's scaling_cur_freq where exposed, else
    /proc/cpuinfo; None where neither is readable."""
    freqs = []
    for p in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq"):
        text = _read(str(p))
        if text and text.strip().isdigit():
            freqs.append(int(text) / 1000)
    if freqs:
        return float(np.mean(freqs))
    text = _read("/proc/cpuinfo")
    return parse_cpu_mhz(text) if text else None


def sample() -> dict[str, Any]:
    """This moment's host figures, and this process's CPU seconds (all its threads). Fields
    are None where /proc is not readable (not Linux)."""
    stat, load = _read("/proc/stat"), _read("/proc/loadavg")
    jiffies = parse_proc_stat(stat) if stat else {}
    return {
        "wall_s": time.monotonic(),
        "own_cpu_s": time.process_time(),
        "load1": parse_loadavg(load) if load else None,
        "busy_j": jiffies.get("busy"),
        "steal_j": jiffies.get("steal"),
        "total_j": jiffies.get("total"),
        "cores": jiffies.get("cores") or None,
        "mhz": read_mhz(),
    }


def round_state(
    before: Mapping[str, Any], after: Mapping[str, Any], own_cpu_s: float
) -> dict[str, float | None]:
    """One round's host state from the samples around it and the CPU seconds the sweep's
    ranks used in it (summed over ranks): cores other processes kept busy, steal share of all
    CPU time, load average and MHz (means of the two samples)."""
    wall = after["wall_s"] - before["wall_s"]
    out: dict[str, float | None] = {"load1": _mean(before["load1"], after["load1"])}
    out["mhz"] = _mean(before["mhz"], after["mhz"])
    if before["busy_j"] is None or after["busy_j"] is None or wall <= 0:
        out["other_cores"] = out["steal"] = out["free_cores"] = None
        return out
    busy_s = (after["busy_j"] - before["busy_j"]) / CLOCK_TICKS
    total = after["total_j"] - before["total_j"]
    out["other_cores"] = max(busy_s - own_cpu_s, 0.0) / wall
    cores = after.get("cores")
    out["free_cores"] = max(cores - out["other_cores"], 0.0) if cores else None
    out["steal"] = (after["steal_j"] - before["steal_j"]) / total if total > 0 else 0.0
    return out


def _mean(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (a + b) / 2


SUMMARY = ("other_cores", "free_cores", "steal", "load1", "mhz", "ref_s")


def summarise(rounds: Iterable[Mapping[str, Any]]) -> dict[str, float | None]:
    """A run's host state: the median over its rounds of each figure of :data:`SUMMARY`
    (None when no round has it), and ``ref_spread``: the log sd of its blocks' median
    reference times (None with fewer than two blocks)."""
    rows = list(rounds)
    out: dict[str, float | None] = {}
    for key in SUMMARY:
        values = [float(r[key]) for r in rows if r.get(key) is not None and r[key] == r[key]]
        out[key] = float(np.median(values)) if values else None
    blocks: dict[Any, list[float]] = {}
    for r in rows:
        if r.get("ref_s") is not None and r["ref_s"] == r["ref_s"] and r["ref_s"] > 0:
            blocks.setdefault(r.get("block", 0), []).append(float(r["ref_s"]))
    medians = [math.log(float(np.median(v))) for v in blocks.values()]
    out["ref_spread"] = float(np.std(medians, ddof=1)) if len(medians) >= 2 else None
    return out


def reference_limit(a: Mapping[str, float | None], b: Mapping[str, float | None]) -> float:
    """How far apart (log) two runs' reference times may be on hosts that did not differ:
    :data:`REF_Z` x the sd of their difference, each run's sd the larger of its blocks'
    measured spread and :data:`REF_RUN_SD`; at least the fixed ``ref_ratio`` limit."""
    var = sum(max(s.get("ref_spread") or 0.0, REF_RUN_SD) ** 2 for s in (a, b))
    return max(math.log(LIMITS["ref_ratio"]), REF_Z * math.sqrt(var))


def judge_hosts(
    a: Mapping[str, float | None],
    b: Mapping[str, float | None],
    limits: Mapping[str, float] = LIMITS,
) -> list[str]:
    """What differed between two runs' host summaries beyond :data:`LIMITS`, in words with
    the figures; empty when nothing did (or nothing was recorded to judge)."""
    out = []
    oa, ob = a.get("other_cores"), b.get("other_cores")
    if oa is not None and ob is not None and abs(oa - ob) > limits["other_cores"]:
        out.append(f"other processes' CPU {oa:.2f} vs {ob:.2f} cores")
    fa, fb = a.get("free_cores"), b.get("free_cores")
    if fa is not None and fb is not None:  # on a saturated host a hog shows here, not above
        low, high = sorted((max(fa, FREE_FLOOR), max(fb, FREE_FLOOR)))
        if high / low > limits["free_ratio"]:
            out.append(f"cores left to the sweep {fa:.2f} vs {fb:.2f}")
    sa, sb = a.get("steal"), b.get("steal")
    if sa is not None and sb is not None and abs(sa - sb) > limits["steal"]:
        out.append(f"CPU steal {sa:.1%} vs {sb:.1%}")
    x, y = a.get("mhz"), b.get("mhz")
    if x and y and max(x / y, y / x) > limits["mhz_ratio"]:
        out.append(f"CPU MHz {x:.0f} vs {y:.0f}")
    x, y = a.get("ref_s"), b.get("ref_s")
    if x and y and math.isfinite(limits["ref_ratio"]):
        limit = max(math.log(limits["ref_ratio"]), reference_limit(a, b))
        if abs(math.log(x / y)) > limit:
            out.append(f"reference time {x:.3g} s vs {y:.3g} s (limit {math.expm1(limit):.0%})")
    return out
