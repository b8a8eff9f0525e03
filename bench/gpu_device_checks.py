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
  inside its step, one per action, never overlapping another; busy + gaps = the step window
  within 1%; and, with nothing to wait for, the bubble ratio under 0.05.
- ``host-bound``: stage 0 sleeps before launching its forward kernels; its F rows must show
  the device's time (well under the sleep) while their launch spans hold the sleep: the sleep
  is device idle, not compute.
- ``nccl-two-gpus``: ``vpipe run`` on two GPUs over NCCL, profiled: every compute row on the
  device clock, one per action, and the waits for receives as device gaps; skipped (one line)
  with fewer than two GPUs.

The pure parts (:func:`agreement`, :func:`timeline_findings`) are tested on the CPU with
synthetic CUDA-style traces.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

AGREE = 0.05  # events against the profiler's device rows
TIMELINE = 0.01  # busy + gaps against the step window
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


def timeline_findings(events: Any) -> dict[str, Any]:
    """Per (rank, step) of a converted trace: whether every compute row is on the device clock
    and inside the step window, no two overlap, and busy + gaps = window (worst error)."""
    from vpipe.events import COMPUTE_KINDS

    worst, ok = 0.0, True
    for (_, _), g in events.groupby(["rank", "step"], observed=True):
        k = g["kind"].astype(str)
        step = g[(k == "other") & (g["name"].astype(str) == "STEP")]
        rows = g[k.isin(COMPUTE_KINDS)].sort_values("start_ns")
        if len(step) != 1 or rows.empty:
            return {"ok": False, "worst": float("inf"), "why": "a step without its span or rows"}
        w0, w1 = int(step["start_ns"].iloc[0]), int(step["end_ns"].iloc[0])
        s, e = rows["start_ns"].to_numpy(), rows["end_ns"].to_numpy()
        ok &= bool((rows["clock"].astype(str) == "device").all())
        ok &= bool(s.min() >= w0 and e.max() <= w1 and (s[1:] >= e[:-1]).all())
        busy = int((e - s).sum())
        gaps = int(s[0] - w0) + int((s[1:] - e[:-1]).clip(min=0).sum()) + int(w1 - e.max())
        worst = max(worst, abs(busy + gaps - (w1 - w0)) / (w1 - w0))
    return {"ok": ok and worst <= TIMELINE, "worst": worst, "why": ""}


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


def _profile(h: Any, out: Path, ahead_cycles: int = 0) -> Any:
    """One profiled step (after one traced warm-up), each step behind a sleep kernel of
    ``ahead_cycles`` when nonzero; the converted events."""
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
    return convert([p.path]).events


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
        busy = _profile(h, out / "ahead", ahead)
        results.append(_events_vs_profiler(h, busy))
        plain = _profile(h, out / "plain")
        r = rank_metrics(plain).iloc[0]
        results.append(_timeline(plain, r))
        mod = h.pipe.stages[0].module
        launch = mod.forward
        mod.forward = lambda *a, **k: (time.sleep(SLEEP_S), launch(*a, **k))[1]
        try:
            slow = _profile(h, out / "host-bound")
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
    a = agreement(times, rows)
    ok = a["total"] <= AGREE and a["median"] <= AGREE
    empty = sum(v == 0 for v in rows.values())
    return ("events-vs-profiler", ok,
            f"{a['actions']} actions with GPU work ({empty} with none), device kept busy so the "
            f"host ran ahead: {sum(rows.values()) / 1e6:.3f} ms by the profiler's device rows, "
            f"{sum(times.get(k, 0) for k in rows) / 1e6:.3f} ms by CUDA events; they differ by "
            f"{a['total']:.2%} in total, {a['median']:.2%} per action (median; tolerance "
            f"{AGREE:.0%})")  # fmt: skip


def _timeline(events: Any, r: Any) -> tuple[str, bool, str]:
    t = timeline_findings(events)
    ok = t["ok"] and r["bubble_ratio"] < BUBBLE_P1
    return ("device-timeline", ok,
            f"busy {r['busy_s'] * 1e3:.3f} ms + bubble {r['idle_s'] * 1e3:.3f} ms = step "
            f"{r['window_s'] * 1e3:.3f} ms (bubble ratio {r['bubble_ratio']:.3f}, under "
            f"{BUBBLE_P1} at P=1: {'yes' if r['bubble_ratio'] < BUBBLE_P1 else 'NO'}); busy + "
            f"gaps off the window by {t['worst']:.2%} (tolerance {TIMELINE:.0%}); "
            + ("rows on the device clock, inside the step, no overlap" if t["ok"]
               else "rows NOT all on the device clock, inside the step and apart")
            + (f"; {t['why']}" if t["why"] else ""))  # fmt: skip


def _host_bound(events: Any, slow: Any, plain: Any) -> tuple[str, bool, str]:
    f0 = events[(events["kind"].astype(str) == "F") & (events["stage"] == 0)]
    device_ms = float((f0["end_ns"] - f0["start_ns"]).median()) / 1e6
    launch_ms = float((f0["launch_end_ns"] - f0["launch_start_ns"]).median()) / 1e6
    ok = device_ms < 0.5 * SLEEP_S * 1e3 and launch_ms >= SLEEP_S * 1e3
    ok &= bool((f0["clock"].astype(str) == "device").all()) and len(f0) > 0
    return ("host-bound", ok,
            f"stage 0 sleeps {SLEEP_S * 1e3:.0f} ms before each forward launch: its F rows "
            f"{device_ms:.3f} ms on the device (median), launch spans {launch_ms:.3f} ms; bubble "
            f"ratio {plain['bubble_ratio']:.3f} -> {slow['bubble_ratio']:.3f}, idle "
            f"{plain['idle_s'] * 1e3:.2f} -> {slow['idle_s'] * 1e3:.2f} ms")  # fmt: skip


def nccl_check(out_dir: Path, sizes: Mapping[str, int], batch: int, timeout_s: float = 240.0
               ) -> tuple[str, bool | None, str]:  # fmt: skip
    """``vpipe run zbv -p 2`` over NCCL on two GPUs, profiled; None (skipped) with fewer."""
    import torch

    from vpipe.events import COMPUTE_KINDS
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
    ev = trace.events
    program = make_schedule("zbv", 2, 4)
    want = {
        k: sum(len(a.compute_parts()) for a in program.actions[k] if a.is_compute) for k in (0, 1)
    }
    compute = ev[ev["kind"].astype(str).isin(COMPUTE_KINDS)]
    got = compute.groupby(["rank", "step"], observed=True).size()
    rows = {k: sorted(set(got[k].tolist())) if k in got else [] for k in want}
    counts_ok = all(rows[k] == [want[k]] for k in want)
    waits = ev[ev["kind"].astype(str) == "WAIT"]
    wait_ms = waits.groupby("rank", observed=True).apply(
        lambda w: float((w["end_ns"] - w["start_ns"]).sum()) / 1e6, include_groups=False
    )
    ok = (
        counts_ok
        and trace.meta["clock"] == "device"
        and set(waits["clock"].astype(str)) <= {"device"}
    )
    return (name, ok,
            f"clock {trace.meta['clock']}; compute rows per step "
            f"{', '.join(f'rank {k} {rows[k]} (program {want[k]})' for k in want)}; "
            f"device waits per profiled step window: "
            f"{', '.join(f'rank {k} {v:.3f} ms' for k, v in wait_ms.items())}")  # fmt: skip
