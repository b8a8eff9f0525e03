"""Synthetic Kineto traces shaped like the runtime's, for tests and the conversion benchmark.

:func:`synthetic_trace` lays out given per-rank action programs back to back on a fake clock,
with the spans the runtime records (``ProfilerStep#N`` > ``PP:STEP:k`` > ``PP:{action}``, a
``PP:WAIT:{recv}`` at the start of each received input's consumer, inside its span), ``ops_per_action`` nested ``aten::`` CPU ops
per action and a ``[memory]`` instant event per op, as torch.profiler writes them. With
``gpu_annotations`` it is a CUDA run as Kineto records it: the CPU spans are launches (short,
early; a ``PP:WAIT`` returns at once, as NCCL's ``Work.wait()`` does), and a
``gpu_user_annotation`` copy of each action's span on a GPU stream (same name) holds what the
device did: later and longer (``device_scale`` times the launch), one action after another
on the stream, a consumer of a received input ``device_wait_us`` after the device's previous
action; the step span ends after the device synchronise. The converter must use these device
intervals and never count an action twice.

``python -m vpipe.trace.synth [--mb 30] [--no-memory]`` writes a ~30 MB two-rank trace to a
temp directory and prints the end-to-end conversion speed (trace events per second, JSON files
to event and memory tables), with or without ``[memory]`` events.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from vpipe.ir import Action, Kind
from vpipe.trace.record import trace_file_name

_BASE_NS = 1_700_000_000_000_000_000
_OPS = ("aten::linear", "aten::addmm", "aten::relu", "aten::mm", "aten::add_", "aten::sum")


def synthetic_trace(
    programs: Sequence[Sequence[Action]],
    rank: int,
    *,
    steps: Sequence[int] = (0,),
    ops_per_action: int = 2,
    wait_us: float = 3.0,
    memory_events: bool = True,
    gpu_annotations: bool = False,
    device_scale: float = 4.0,
    device_wait_us: float = 4.0,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The Kineto JSON document of rank ``rank`` running ``programs[rank]`` for ``steps``
    (with a ``[memory]`` event per op when ``memory_events``, as ``profile_memory=True``, and
    as a CUDA run with device spans when ``gpu_annotations``: see the module docstring)."""
    events: list[dict[str, Any]] = []
    pid = 1000 + rank
    ts = 10_000.0 + 7.0 * rank  # microseconds since baseTimeNanoseconds; ranks skewed a bit
    ext = 0

    def span(name: str, start: float, dur: float, cat: str = "user_annotation") -> None:
        nonlocal ext
        ext += 1
        events.append(
            {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": pid, "ts": round(start, 3),
             "dur": round(dur, 3), "args": {"External id": ext, "Record function id": 0, "Ev Idx": ext}}
        )  # fmt: skip

    device: list[tuple[str, float, float]] = []  # the GPU stream's spans (name, ts, dur)
    host_wait = 0.3 if gpu_annotations else wait_us  # NCCL: the stream waits, not the host
    for k in steps:
        step_start = ts
        body: list[tuple[str, float, float]] = []
        t = ts + 1.0
        dev_free, dev_first = t, None
        pending: dict[tuple[int, int, Kind], Action] = {}
        for a in programs[rank]:
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                pending[(a.stage, a.microbatch, a.kind)] = a
            need = Kind.RECV_F if a.kind is Kind.F else Kind.RECV_B
            recv = pending.pop((a.stage, a.microbatch, need), None) if a.is_compute else None
            wait = host_wait + 0.5 if recv else 0.0
            dur = 2.0 + 3.0 * ops_per_action + wait
            body.append((f"PP:{a}", t, dur))
            if recv:  # the runtime waits for an input inside the consuming action's span
                body.append((f"PP:WAIT:{recv}", t + 0.2, host_wait))
            if gpu_annotations and a.is_compute:
                start = max(t + 5.0, dev_free + (device_wait_us if recv else 0.0))
                dev_free = start + device_scale * (dur - wait)
                device.append((f"PP:{a}", start, dev_free - start))
                dev_first = start if dev_first is None else dev_first
            for j in range(ops_per_action):
                op_t = t + wait + 0.5 + 3.0 * j
                span(_OPS[j % len(_OPS)], op_t, 2.5, cat="cpu_op")
                if not memory_events:
                    continue
                events.append(
                    {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",
                     "pid": pid, "tid": pid, "ts": round(op_t + 0.1, 3),
                     "args": {"Total Reserved": 0, "Total Allocated": 4096 * (j + 1),
                              "Bytes": 4096, "Device Id": -1, "Device Type": 0, "Addr": 1 + j,
                              "Ev Idx": ext}}
                )  # fmt: skip
            t += dur + 0.5
        if dev_first is not None:  # the step ends with a device synchronise
            device.append((f"PP:STEP:{k}", dev_first, dev_free - dev_first))
            t = max(t, dev_free + 1.0)
        span(f"ProfilerStep#{k}", step_start, t - step_start + 1.0)
        span(f"PP:STEP:{k}", step_start + 0.2, t - step_start)
        for name, start, dur in body:
            span(name, start, dur)
        ts = t + 2.0
    for name, start, dur in device:  # Kineto's device-side copies of record_function ranges
        events.append(
            {"ph": "X", "cat": "gpu_user_annotation", "name": name, "pid": rank, "tid": 7,
             "ts": round(start, 3), "dur": round(dur, 3),
             "args": {"External id": 0, "device": rank, "stream": 7}}
        )  # fmt: skip
    return {
        "schemaVersion": 1,
        "deviceProperties": [],
        "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": len(programs)},
        "vpipe": {**(meta or {}), "rank": rank},
        "baseTimeNanoseconds": _BASE_NS,
        "displayTimeUnit": "ms",
        "traceEvents": events,
    }


def write_synthetic_run(
    out_dir: str | Path, programs: Sequence[Sequence[Action]], **kwargs: Any
) -> list[Path]:
    """Write each rank's trace to ``out_dir`` (named as :class:`~vpipe.trace.record.StepProfiler`
    names them); return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(len(programs)):
        path = out / trace_file_name(r)
        doc = synthetic_trace(programs, r, **kwargs)
        path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))  # Kineto-like layout
        paths.append(path)
    return paths


def _bench(megabytes: float, memory_events: bool) -> None:
    from vpipe.ir import actions_from_strings
    from vpipe.trace.kineto import convert

    programs = actions_from_strings(
        [
            ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
            ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        kw = {"ops_per_action": 40, "memory_events": memory_events}
        one = write_synthetic_run(tmp, programs, steps=range(1), **kw)
        per_step = sum(p.stat().st_size for p in one)
        n_steps = max(1, round(megabytes * 1e6 / per_step))
        paths = write_synthetic_run(tmp, programs, steps=range(n_steps), **kw)
        size = sum(p.stat().st_size for p in paths)
        t0, c0 = time.perf_counter(), time.process_time()
        trace = convert(paths)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"{size / 1e6:.1f} MB, {trace.n_trace_events} trace events -> {len(trace.events)} event "
        f"rows + {len(trace.memory)} memory rows in {dt:.2f} s: "
        f"{trace.n_trace_events / dt / 1e3:.0f}k trace events/s "
        f"({cpu:.2f} s CPU: {trace.n_trace_events / cpu / 1e3:.0f}k/s)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=30.0, help="trace size in MB (default 30)")
    parser.add_argument("--no-memory", action="store_true", help="no [memory] events")
    args = parser.parse_args()
    _bench(args.mb, not args.no_memory)
