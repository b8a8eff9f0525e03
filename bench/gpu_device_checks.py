"""The device-clock checks of ``make gpu-check`` (bench/gpu_check.py), CUDA only.

- ``events-vs-profiler``: one profiled step of zbv at P=1 (GPT) with per-action CUDA events on:
  each compute action's event time against its device span in the converted trace; PASS when
  the total and the median action agree within 5%.
- ``device-timeline``: in that trace, every compute row is on the device clock, inside its
  step, one per action and never overlapping another; device busy time plus the gaps between
  rows (the bubble) equals the step window within 1%.
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
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

AGREE = 0.05  # events against the profiler's device spans
TIMELINE = 0.01  # busy + gaps against the step window
SLEEP_S = 0.02  # the host-bound stage's stall before each forward


def agreement(events_ns: Mapping[str, int], spans_ns: Mapping[str, int]) -> dict[str, float]:
    """Relative differences of per-action durations from CUDA events and from the profiler's
    device spans, over the actions both have: ``total`` and ``median`` (per action)."""
    common = sorted(set(events_ns) & set(spans_ns))
    if not common:
        return {"actions": 0, "total": float("inf"), "median": float("inf")}
    rel = [abs(events_ns[a] - spans_ns[a]) / max(spans_ns[a], 1) for a in common]
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


def _profile(h: Any, out: Path) -> Any:
    meta = {"run_id": out.name, "impl": "vpipe", "schedule": "zbv", "device": "cuda"}
    return h.profiled_step(out, meta)


def _durations(events: Any) -> dict[str, int]:
    from vpipe.events import COMPUTE_KINDS

    rows = events[events["kind"].astype(str).isin(COMPUTE_KINDS)]
    return dict(
        zip(rows["name"].astype(str), (rows["end_ns"] - rows["start_ns"]).astype(int), strict=True)
    )


def device_checks(sizes: Mapping[str, int], batch: int) -> list[tuple[str, bool, str]]:
    """The three one-GPU checks, in this process (a process group of one)."""
    import torch.distributed as dist

    from vpipe.metrics.per_run import rank_metrics

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out: list[tuple[str, bool, str]] = []
    try:
        h = _one_rank_harness(sizes, batch)
        for _ in range(3):
            h.step()  # shapes, allocator, kernels warmed up
        with tempfile.TemporaryDirectory(prefix="vpipe-gpu-dev-") as tmp:
            events = _profile(h, Path(tmp) / "plain")
            times = {t.action: t.end_ns - t.start_ns for t in h.stats["action_times"]}
            spans = _durations(events)
            a = agreement(times, spans)
            ok = a["total"] <= AGREE and a["median"] <= AGREE
            out.append(("events-vs-profiler", ok,
                        f"{a['actions']} actions: total {sum(spans.values()) / 1e6:.3f} ms by "
                        f"device spans, {sum(times.get(k, 0) for k in spans) / 1e6:.3f} ms by "
                        f"CUDA events; differ by {a['total']:.1%} in total, {a['median']:.1%} "
                        f"per action (median; tolerance {AGREE:.0%})"))  # fmt: skip
            t = timeline_findings(events)
            r = rank_metrics(events).iloc[0]
            out.append(("device-timeline", t["ok"],
                        f"busy {r['busy_s'] * 1e3:.3f} ms + bubble {r['idle_s'] * 1e3:.3f} ms = "
                        f"step {r['window_s'] * 1e3:.3f} ms (bubble ratio {r['bubble_ratio']:.3f});"
                        f" busy + gaps off the window by {t['worst']:.2%} (tolerance "
                        f"{TIMELINE:.0%}); "
            + ("rows on the device clock, inside the step, no overlap" if t["ok"]
               else "rows NOT all on the device clock, inside the step and apart")
                        + (f"; {t['why']}" if t["why"] else "")))  # fmt: skip
            mod = h.pipe.stages[0].module
            launch = mod.forward
            mod.forward = lambda *a, **k: (time.sleep(SLEEP_S), launch(*a, **k))[1]
            try:
                slow = _profile(h, Path(tmp) / "host-bound")
            finally:
                del mod.forward
        out.append(_host_bound(slow, rank_metrics(slow).iloc[0], r))
    finally:
        if own:
            dist.destroy_process_group()
    return out


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
