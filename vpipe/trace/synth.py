"""Synthetic Kineto traces shaped like the runtime's, for tests and the conversion benchmark.

:func:`synthetic_trace` lays out given per-rank action programs back to back on a fake clock,
with the spans the runtime records (``ProfilerStep#N`` > ``PP:STEP:k`` > ``PP:{action}``, a
``PP:WAIT:{recv}`` at the start of each received input's consumer, inside its span), ``ops_per_action`` nested ``aten::`` CPU ops
per action and a ``[memory]`` instant event per op, as torch.profiler writes them. With
``gpu`` it is a CUDA run as Kineto records it: the CPU spans are launches (short, early; a
``PP:WAIT`` returns at once, as NCCL's ``Work.wait()`` does); each compute action launches
``ops_per_action`` kernels on stream 7 (a forward from the main thread, a backward's first
kernel from the main thread and the rest from autograd's worker thread, as PyTorch does), each
joined to its launch call by a correlation id and labelled with its action in its args
(``synthetic_owner``: the ground truth for tests; the converter never reads it). The device
runs them later and longer (``device_scale`` times the launch), one after another; a received
input is an NCCL kernel launched by its RECV, whose data arrives ``device_wait_us`` after the
device's previous work; Kineto's ``gpu_user_annotation`` copy of each action's span covers
its main-thread kernels only (never read for rows); gloo's own thread copies a tensor once per step (no action's work);
the actions in ``launches_nothing`` launch no kernel; the step span ends after the device
synchronise.

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
    gpu: bool = False,
    device_scale: float = 4.0,
    device_wait_us: float = 4.0,
    launches_nothing: frozenset[str] = frozenset(),
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The Kineto JSON document of rank ``rank`` running ``programs[rank]`` for ``steps``
    (with a ``[memory]`` event per op when ``memory_events``, as ``profile_memory=True``, and
    as a CUDA run with GPU activity when ``gpu``: see the module docstring)."""
    events: list[dict[str, Any]] = []
    pid = 1000 + rank
    autograd_tid, gloo_tid = pid + 50_000, pid + 1  # autograd's worker, gloo's I/O thread
    ts = 10_000.0 + 7.0 * rank  # microseconds since baseTimeNanoseconds; ranks skewed a bit
    ext = 0
    corr = 0

    def span(name: str, start: float, dur: float, cat: str = "user_annotation") -> None:
        nonlocal ext
        ext += 1
        events.append(
            {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": pid, "ts": round(start, 3),
             "dur": round(dur, 3), "args": {"External id": ext, "Record function id": 0, "Ev Idx": ext}}
        )  # fmt: skip

    def gpu_op(name: str, launch: float, tid: int, start: float, dur: float, stream: int,
               owner: str, cat: str = "kernel") -> None:  # fmt: skip
        """A launch call on thread ``tid`` and the op it launched, sharing a correlation id;
        ``owner`` (the action it belongs to, "" for none) is the ground truth for tests."""
        nonlocal corr
        corr += 1
        events.append(
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid,
             "ts": round(launch, 3), "dur": 3.0, "args": {"cbid": 211, "correlation": corr}}
        )  # fmt: skip
        events.append(
            {"ph": "X", "cat": cat, "name": name, "pid": rank, "tid": stream,
             "ts": round(start, 3), "dur": round(dur, 3),
             "args": {"device": rank, "stream": stream, "correlation": corr,
                      "synthetic_owner": owner}}
        )  # fmt: skip

    host_wait = 0.3 if gpu else wait_us  # NCCL: the stream waits, not the host
    for k in steps:
        step_start = ts
        body: list[tuple[str, float, float]] = []
        t = ts + 1.0
        dev_free = t
        pending: dict[tuple[int, int, Kind], tuple[Action, float]] = {}
        for a in programs[rank]:
            need = Kind.RECV_F if a.kind is Kind.F else Kind.RECV_B
            got = pending.pop((a.stage, a.microbatch, need), None) if a.is_compute else None
            wait = host_wait + 0.5 if got else 0.0
            dur = 2.0 + 3.0 * ops_per_action + wait
            body.append((f"PP:{a}", t, dur))
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                pending[(a.stage, a.microbatch, a.kind)] = (a, t)
            if got:  # the runtime waits for an input inside the consuming action's span
                body.append((f"PP:WAIT:{got[0]}", t + 0.2, host_wait))
            if gpu and got:  # the receive's NCCL kernel, launched by the RECV: data arrives
                arrive = dev_free + device_wait_us  # device_wait_us after the device's work
                gpu_op("ncclDevKernel_SendRecv", got[1] + 0.5, pid, got[1] + 5.0,
                       arrive - got[1] - 5.0, 20, f"RECV:{got[0]}")  # fmt: skip
                dev_free = arrive
            if gpu and a.is_compute and str(a) not in launches_nothing:
                # F launches from the main thread; a backward's first kernel (the gradient
                # seed's fill) too, and the rest from autograd's worker thread
                n = max(1, ops_per_action)
                main: list[tuple[float, float]] = []  # the main thread's kernels
                for j in range(n):
                    launch = t + wait + 0.5 + (dur - wait - 1.0) * j / n
                    tid = pid if a.kind is Kind.F or j == 0 else autograd_tid
                    start = max(launch + 5.0, dev_free + (0.5 if j else 0.0))
                    length = device_scale * (dur - wait) / n
                    gpu_op(f"kernel_{a.kind.value}_{j}", launch, tid, start, length, 7, str(a))
                    dev_free = start + length
                    if tid == pid:
                        main.append((start, dev_free))
                # Kineto's device copy of the span: the main thread's kernels only
                events.append(
                    {"ph": "X", "cat": "gpu_user_annotation", "name": f"PP:{a}", "pid": rank,
                     "tid": 7, "ts": round(main[0][0], 3), "dur": round(main[-1][1] - main[0][0], 3),
                     "args": {"External id": 0, "device": rank, "stream": 7}}
                )  # fmt: skip
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
        if gpu:  # gloo's own thread copies a tensor in the middle of the step: no action's
            gpu_op("Memcpy DtoH", (step_start + t) / 2, gloo_tid, (step_start + t) / 2 + 2.0,
                   1.0, 28, "", cat="gpu_memcpy")  # fmt: skip
            t = max(t, dev_free + 1.0)  # the step ends with a device synchronise
        span(f"ProfilerStep#{k}", step_start, t - step_start + 1.0)
        span(f"PP:STEP:{k}", step_start + 0.2, t - step_start)
        for name, start, dur in body:
            span(name, start, dur)
        ts = t + 2.0
    if gpu:
        events += [
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
             "args": {"name": f"thread {tid} ({name})"}}
            for tid, name in ((pid, "python3"), (gloo_tid, "pt_gloo_runloop"))
        ]  # fmt: skip
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
