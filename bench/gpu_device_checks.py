"""The device-clock checks of ``make gpu-check`` (bench/gpu_check.py), on one CUDA device.

All on zbv at P=1 (both stages on one rank, nothing communicated) with a GPT model sized so that
every action is compute (milliseconds of kernels):

- ``events-vs-profiler``: one profiled step with per-action CUDA events, the device kept busy
  by a sleep kernel before the step so that the host has enqueued the whole step before the
  device starts it. A CUDA event then completes when the stream reaches it, not when the host
  records it, so an action's event pair spans its own GPU work plus the device's own gap between
  two queued kernels: it must agree with the profiler's row (first op to last op) within 5%,
  total and median per action. (On an idle stream an event completes when the host records it:
  the pair would add the host's launch lead-in, a different quantity.)
- ``device-timeline``: in a plain profiled step every compute row is on the device clock,
  inside its step, one per action, never overlapping another; the rows' busy time against the
  union of every GPU op the trace holds in the step (read from the raw trace, not through the
  conversion) within 1%: work lost or invented by the conversion shows there; and, with
  nothing to wait for, the bubble ratio under 0.05.
- ``host-bound``: stage 0 sleeps before launching its forward kernels; its F rows must show
  the device's time (well under the sleep) while their launch spans hold the sleep: the sleep
  is device idle, not compute.
- ``nccl-two-gpus``: ``vpipe run`` on two GPUs over NCCL, profiled: every compute row on the
  device clock, one per action, and the waits for receives as device gaps; skipped (one line)
  with fewer than two GPUs.

Each check's verdict is a pure function of what it measured (:func:`events_verdict`,
:func:`timeline_findings`, :func:`kernel_union_findings`, :func:`host_bound_verdict`,
:func:`nccl_verdict`), tested on the CPU with synthetic CUDA-style traces: each passes the
right input and fails one built to break it.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

AGREE = 0.05  # events against the profiler's device rows
UNION = 0.01  # the compute rows' busy time against the union of the step's GPU ops
BUBBLE_P1 = 0.05  # the bubble ratio at P=1, where nothing waits
SLEEP_S = 0.02  # the host-bound stage's stall before each forward
# every action milliseconds of compute in bf16 on an H200-class GPU
SIZES = {"vocab": 32768, "d_model": 2048, "n_heads": 16, "n_layers": 4, "seq_len": 1024}
BATCH = 8


def agreement(events_ns: Mapping[str, int], spans_ns: Mapping[str, int]) -> dict[str, float]:
    """Relative differences of per-action durations from CUDA events and from the profiler's
    device rows, over the actions both have with a nonzero row: ``total`` and ``median``."""
    common = sorted(a for a in set(events_ns) & set(spans_ns) if spans_ns[a] > 0)
    if not common:
        return {"actions": 0, "total": float("inf"), "median": float("inf")}
    rel = [abs(events_ns[a] - spans_ns[a]) / spans_ns[a] for a in common]
    ev, sp = sum(events_ns[a] for a in common), sum(spans_ns[a] for a in common)
    return {
        "actions": len(common),
        "total": abs(ev - sp) / max(sp, 1),
        "median": statistics.median(rel),
    }


def events_verdict(events_ns: Mapping[str, int], rows_ns: Mapping[str, int]) -> tuple[bool, dict]:
    """Whether CUDA events and the profiler's device rows agree on per-action durations (two
    clocks of the same actions) within :data:`AGREE`, total and median; and the figures."""
    a = agreement(events_ns, rows_ns)
    return a["actions"] > 0 and a["total"] <= AGREE and a["median"] <= AGREE, a


def timeline_findings(events: Any) -> dict[str, Any]:
    """Per (rank, step) of a converted trace: whether every compute row is on the device clock
    and inside the step window, and no two overlap; ``why`` names the first that fails."""
    from vpipe.events import COMPUTE_KINDS

    for (rank, step), g in events.groupby(["rank", "step"], observed=True):
        k = g["kind"].astype(str)
        window = g[(k == "other") & (g["name"].astype(str) == "STEP")]
        rows = g[k.isin(COMPUTE_KINDS)].sort_values("start_ns")
        where = f"rank {rank} step {step}"
        if len(window) != 1 or rows.empty:
            return {"ok": False, "why": f"{where}: no step span or no compute rows"}
        w0, w1 = int(window["start_ns"].iloc[0]), int(window["end_ns"].iloc[0])
        s, e = rows["start_ns"].to_numpy(), rows["end_ns"].to_numpy()
        if not (rows["clock"].astype(str) == "device").all():
            return {"ok": False, "why": f"{where}: compute rows not on the device clock"}
        if s.min() < w0 or e.max() > w1:
            return {"ok": False, "why": f"{where}: a compute row outside its step"}
        if (s[1:] < e[:-1]).any():
            i = int(np.flatnonzero(s[1:] < e[:-1])[0])
            names = rows["name"].astype(str).to_numpy()
            return {"ok": False, "why": f"{where}: rows {names[i]} and {names[i + 1]} overlap"}
    return {"ok": True, "why": ""}


def union_ns(starts: Any, ends: Any) -> int:
    """The total length of the union of intervals [start, end)."""
    from vpipe.trace.gpu_owners import union_length

    return union_length(np.asarray(starts), np.asarray(ends))


def trace_ops_ns(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Every GPU op of a raw trace file but NCCL's own kernels (kernels, copies, memsets,
    whoever launched them), on the event table's clock: (starts, ends) in ns."""
    from vpipe.trace.kineto_json import read_trace

    raw = read_trace(path)
    base = int(raw.header.get("baseTimeNanoseconds") or 0)
    keep = ~np.asarray(raw.gpu.op_is_nccl, bool)
    start = base + np.rint(np.asarray(raw.gpu.op_ts, np.float64)[keep] * 1000).astype(np.int64)
    dur = np.rint(np.asarray(raw.gpu.op_dur, np.float64)[keep] * 1000).astype(np.int64)
    return start, start + dur


def kernel_union_findings(events: Any, op_start: Any, op_end: Any) -> dict[str, Any]:
    """One rank's compute rows against the GPU ops themselves, per step: the rows' busy time
    (sum of ``busy_ns``) over the union of the ops that start inside the step window; ``worst``
    the largest relative difference, ``ok`` when it is within :data:`UNION`."""
    from vpipe.events import COMPUTE_KINDS

    worst = 0.0
    op_start, op_end = np.asarray(op_start), np.asarray(op_end)
    for _, g in events.groupby("step", observed=True):
        k = g["kind"].astype(str)
        window = g[(k == "other") & (g["name"].astype(str) == "STEP")]
        if len(window) != 1:
            return {"ok": False, "worst": float("inf"), "why": "a step without its span"}
        w0, w1 = int(window["start_ns"].iloc[0]), int(window["end_ns"].iloc[0])
        inside = (op_start >= w0) & (op_start < w1)
        ops = union_ns(op_start[inside], op_end[inside])
        busy = int(g.loc[k.isin(COMPUTE_KINDS), "busy_ns"].sum())
        worst = max(worst, abs(busy - ops) / max(ops, 1))
    return {"ok": worst <= UNION, "worst": worst, "why": ""}


def host_bound_verdict(events: Any) -> tuple[bool, float, float]:
    """(ok, device ms, launch ms) of stage 0's F rows in the host-bound step: their device
    time well under the host's sleep, their launch spans holding it, all on the device."""
    f0 = events[(events["kind"].astype(str) == "F") & (events["stage"] == 0)]
    if f0.empty:
        return False, float("nan"), float("nan")
    device_ms = float((f0["end_ns"] - f0["start_ns"]).median()) / 1e6
    launch_ms = float((f0["launch_end_ns"] - f0["launch_start_ns"]).median()) / 1e6
    ok = device_ms < 0.5 * SLEEP_S * 1e3 and launch_ms >= SLEEP_S * 1e3
    return ok and bool((f0["clock"].astype(str) == "device").all()), device_ms, launch_ms


def _one_rank_harness(sizes: Mapping[str, int], batch: int) -> Any:
    from vpipe import lower
    from vpipe.schedules import make_schedule
    from vpipe.sweep.harness import RankSpec, build

    schedule = lower(make_schedule("zbv", 1, 4))
    spec = RankSpec(schedule, model="gpt", sizes=dict(sizes), batch=batch, device="cuda",
                    time_actions=True)  # fmt: skip
    return build(spec, 0)


def _sleep_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds`` (measured)."""
    import torch

    probe = 10**7
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds / (start.elapsed_time(end) / 1e3))


def _profile(h: Any, out: Path, ahead_cycles: int = 0) -> tuple[Any, Path]:
    """One profiled step (after one traced warm-up), each step behind a sleep kernel of
    ``ahead_cycles`` when nonzero; the converted events and the trace file."""
    import torch
    import torch.distributed as dist

    from vpipe.trace.kineto import convert
    from vpipe.trace.record import StepProfiler

    meta = {"run_id": out.name, "impl": "vpipe", "schedule": "zbv", "device": "cuda"}
    with StepProfiler(out, 0, metadata=meta, device=h.device, wait=0, warmup=1, active=1) as p:
        for _ in range(2):
            dist.barrier()
            if ahead_cycles:
                torch.cuda._sleep(ahead_cycles)  # the host enqueues the step meanwhile
            h.step()
            p.step()
    return convert([p.path]).events, Path(p.path)


def _durations(events: Any) -> dict[str, int]:
    from vpipe.events import COMPUTE_KINDS

    rows = events[events["kind"].astype(str).isin(COMPUTE_KINDS)]
    return dict(
        zip(rows["name"].astype(str), (rows["end_ns"] - rows["start_ns"]).astype(int), strict=True)
    )


def device_checks(out: Path, sizes: Mapping[str, int] = SIZES, batch: int = BATCH
                  ) -> list[tuple[str, bool, str]]:  # fmt: skip
    """The three one-GPU checks, in this process (a process group of one); traces under
    ``out`` (plain/, ahead/, host-bound/)."""
    import torch.distributed as dist

    from vpipe.metrics.per_run import rank_metrics

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    results: list[tuple[str, bool, str]] = []
    try:
        h = _one_rank_harness(sizes, batch)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            h.step()  # shapes, allocator, kernels warmed up (each step ends synchronised)
            times.append(time.perf_counter() - t0)
        # a sleep longer than the host takes to enqueue a step (the first step is shape
        # inference and warm-up, left out)
        ahead = _sleep_cycles(2 * statistics.median(times[1:]))
        busy, _ = _profile(h, out / "ahead", ahead)
        results.append(_events_vs_profiler(h, busy))
        plain, path = _profile(h, out / "plain")
        r = rank_metrics(plain).iloc[0]
        results.append(_timeline(plain, r, kernel_union_findings(plain, *trace_ops_ns(path))))
        mod = h.pipe.stages[0].module
        launch = mod.forward
        mod.forward = lambda *a, **k: (time.sleep(SLEEP_S), launch(*a, **k))[1]
        try:
            slow, _ = _profile(h, out / "host-bound")
        finally:
            del mod.forward
        results.append(_host_bound(slow, rank_metrics(slow).iloc[0], r))
    finally:
        if own:
            dist.destroy_process_group()
    return results


def _events_vs_profiler(h: Any, events: Any) -> tuple[str, bool, str]:
    times = {t.action: t.end_ns - t.start_ns for t in h.stats["action_times"]}
    rows = _durations(events)
    ok, a = events_verdict(times, rows)
    empty = sum(v == 0 for v in rows.values())
    return ("events-vs-profiler", ok,
            f"{a['actions']} actions with GPU work ({empty} with none), device kept busy so the "
            f"host ran ahead: {sum(rows.values()) / 1e6:.3f} ms by the profiler's device rows, "
            f"{sum(times.get(k, 0) for k in rows) / 1e6:.3f} ms by CUDA events; they differ by "
            f"{a['total']:.2%} in total, {a['median']:.2%} per action (median; tolerance "
            f"{AGREE:.0%})")  # fmt: skip


def _timeline(events: Any, r: Any, union: Mapping[str, Any]) -> tuple[str, bool, str]:
    t = timeline_findings(events)
    ok = t["ok"] and union["ok"] and r["bubble_ratio"] < BUBBLE_P1
    return ("device-timeline", ok,
            f"busy {r['busy_s'] * 1e3:.3f} ms, bubble {r['idle_s'] * 1e3:.3f} ms, step "
            f"{r['window_s'] * 1e3:.3f} ms (bubble ratio {r['bubble_ratio']:.3f}, under "
            f"{BUBBLE_P1} at P=1: {'yes' if r['bubble_ratio'] < BUBBLE_P1 else 'NO'}); rows' busy "
            f"time off the union of the step's GPU ops by {union['worst']:.2%} (tolerance "
            f"{UNION:.0%}); "
            + ("rows on the device clock, inside the step, no overlap" if t["ok"] else t["why"])
            )  # fmt: skip


def _host_bound(events: Any, slow: Any, plain: Any) -> tuple[str, bool, str]:
    ok, device_ms, launch_ms = host_bound_verdict(events)
    return ("host-bound", ok,
            f"stage 0 sleeps {SLEEP_S * 1e3:.0f} ms before each forward launch: its F rows "
            f"{device_ms:.3f} ms on the device (median), launch spans {launch_ms:.3f} ms; bubble "
            f"ratio {plain['bubble_ratio']:.3f} -> {slow['bubble_ratio']:.3f}, idle "
            f"{plain['idle_s'] * 1e3:.2f} -> {slow['idle_s'] * 1e3:.2f} ms")  # fmt: skip


def nccl_check(out_dir: Path, sizes: Mapping[str, int], batch: int, timeout_s: float = 240.0
               ) -> tuple[str, bool | None, str]:  # fmt: skip
    """``vpipe run zbv -p 2`` over NCCL on two GPUs, profiled; None (skipped) with fewer."""
    import torch

    from vpipe.schedules import make_schedule
    from vpipe.trace.kineto import convert

    name = "nccl-two-gpus"
    if torch.cuda.device_count() < 2:
        return name, None, f"{torch.cuda.device_count()} GPU here, NCCL needs two: skipped"
    argv: Sequence[str] = [sys.executable, "-m", "vpipe", "run", "zbv", "-p", "2", "-m", "4",
                           "--batch", str(batch), "--steps", "3", "--model", "gpt", "--sizes",
                           ",".join(f"{k}={v}" for k, v in sizes.items()), "--device", "cuda",
                           "--backend", "nccl", "--check", "--profile", str(out_dir)]  # fmt: skip
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return name, False, f"vpipe run did not finish in {timeout_s:.0f} s"
    if r.returncode != 0:
        return (
            name,
            False,
            "vpipe run failed: " + " | ".join((r.stdout + r.stderr).splitlines()[-3:]),
        )
    trace = convert([out_dir])
    program = make_schedule("zbv", 2, 4)
    want = {
        k: sum(len(a.compute_parts()) for a in program.actions[k] if a.is_compute) for k in (0, 1)
    }
    ok, detail = nccl_verdict(trace.events, trace.meta["clock"], want)
    return name, ok, detail


def nccl_verdict(ev: Any, clock: str, want: Mapping[int, int]) -> tuple[bool, str]:
    """Whether a converted NCCL run is all on the device clock with ``want[rank]`` compute rows
    per rank and step and its waits on the device; and the figures in words."""
    from vpipe.events import COMPUTE_KINDS

    compute = ev[ev["kind"].astype(str).isin(COMPUTE_KINDS)]
    got = compute.groupby(["rank", "step"], observed=True).size()
    rows = {k: sorted(set(got[k].tolist())) if k in got else [] for k in want}
    counts_ok = all(rows[k] == [want[k]] for k in want)
    waits = ev[ev["kind"].astype(str) == "WAIT"]
    wait_ms = {
        int(k): float((w["end_ns"] - w["start_ns"]).sum()) / 1e6
        for k, w in waits.groupby("rank", observed=True)
    }
    ok = counts_ok and clock == "device" and set(waits["clock"].astype(str)) <= {"device"}
    return ok, (f"clock {clock}; compute rows per step "
                f"{', '.join(f'rank {k} {rows[k]} (program {want[k]})' for k in want)}; "
                f"device waits per profiled step window: "
                f"{', '.join(f'rank {k} {v:.3f} ms' for k, v in wait_ms.items())}")  # fmt: skip
