"""Synthetic CUDA traces of an NCCL run, posted as vpipe's runtime posts: for tests of the
device clock's ownership by message, thread and stream.

:func:`nccl_trace` lays out a rank's lowered program (with its SEND/RECV actions) on a fake
clock, as Kineto records a CUDA run:

- **Posting**: a run of adjacent communication actions is one batch; each has its span, and the
  last one's span launches the batch's NCCL work: one grouped ``ncclDevKernel_SendRecv``
  carrying every message of the batch, sends and receives (``grouped``), or one kernel per
  message in posting order. A RECV that is not last in its batch launches nothing.
- **Data**: a batch's messages land ``transfer_us`` after its kernel starts (a grouped kernel
  ends when its last message lands); the consuming action's ``PP:WAIT:{recv}`` span returns at
  once (NCCL's wait makes the stream wait), and its kernels start after the data; with
  ``launch_lag_us`` the host launches them that much later (launch lag: not waiting).
- **Threads**: a forward launches from the main thread, a backward's first kernel too and the
  rest from autograd's worker thread, which has no name (as in real traces); with ``loader``, a
  data loader's thread (named ``pt_data_loader``, or unnamed with ``loader_named=False``)
  copies a batch to the device three times a step: during a compute span, during a WAIT and
  between actions, on its own stream.
- **Streams**: compute on stream 7, NCCL on 20, the loader's copies on 30; with
  ``side_stream`` every B (and I) also launches one kernel on stream 9 from the main thread.

Every GPU op carries its ground truth in its args (never read by the converter):
``synthetic_owner`` (the action whose compute it is, "" for none), ``synthetic_messages`` (the
RECV actions an NCCL kernel lands) and ``synthetic_side`` (the action a side-stream kernel is
of).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from vpipe.ir import Action, Kind
from vpipe.trace.record import trace_file_name

_BASE_NS = 1_700_000_000_000_000_000
KERNEL_US = 10.0  # each compute kernel on the device
KERNELS = 3  # per compute action


def nccl_trace(
    program: Sequence[Action],
    rank: int,
    *,
    steps: Sequence[int] = (0,),
    grouped: bool = True,
    loader: bool = True,
    loader_named: bool = True,
    side_stream: bool = False,
    transfer_us: float = 60.0,
    launch_lag_us: float = 0.0,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The Kineto JSON document of ``rank`` running ``program`` (see the module docstring)."""
    pid = 2000 + rank
    autograd, loader_tid = pid + 50_000, pid + 7
    events: list[dict[str, Any]] = []
    corr = 0

    def span(name: str, start: float, dur: float) -> None:
        events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": pid, "tid": pid,
                       "ts": round(start, 3), "dur": round(dur, 3), "args": {}})  # fmt: skip

    def op(name: str, launch: float, tid: int, start: float, dur: float, stream: int,
           cat: str = "kernel", **truth: Any) -> None:  # fmt: skip
        nonlocal corr
        corr += 1
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid,
                       "tid": tid, "ts": round(launch, 3), "dur": 2.0,
                       "args": {"correlation": corr}})  # fmt: skip
        events.append({"ph": "X", "cat": cat, "name": name, "pid": rank, "tid": stream,
                       "ts": round(start, 3), "dur": round(dur, 3),
                       "args": {"device": rank, "stream": stream, "correlation": corr, **truth}})  # fmt: skip

    def compute(a: Action, t: float, dev_free: float, landed: dict[str, float],
                loader_at: list[float]) -> tuple[float, float]:  # fmt: skip
        """Lay out compute action ``a`` from host time ``t``: its span, its WAIT for a received
        input, its kernels; returns the host's and the device's next free times."""
        need = f"{a.stage}{'RECV_F' if a.kind is Kind.F else 'RECV_B'}{a.microbatch}"
        got = need if a.kind is not Kind.W and need in landed else None
        lag = launch_lag_us if got else 0.0
        dur = 4.0 + 3.0 * KERNELS + lag
        span(f"PP:{a}", t, dur)
        ready = dev_free
        if got:
            span(f"PP:WAIT:{got}", t + 0.2, 0.3)
            ready = max(ready, landed.pop(got))
            if len(loader_at) == 1:
                loader_at.append(t + 0.4)  # during a WAIT
        for j in range(KERNELS):
            launch = t + 1.0 + lag + 3.0 * j
            tid = pid if a.kind is Kind.F or j == 0 else autograd
            start = max(launch + 5.0, ready)
            op(f"kernel_{a.kind.value}_{j}", launch, tid, start, KERNEL_US, 7,
               synthetic_owner=str(a))  # fmt: skip
            ready = dev_free = start + KERNEL_US
        if side_stream and a.kind in (Kind.B, Kind.I):
            op("side_copy_kernel", t + 2.0, pid, t + 8.0, 4.0, 9, synthetic_owner="",
               synthetic_side=str(a))  # fmt: skip
        if not loader_at:
            loader_at.append(t + 2.5)  # during a compute span
        return t + dur + 0.5, dev_free

    t = 10_000.0 + 7.0 * rank
    for k in steps:
        step_start, dev_free, nccl_free = t, t, t
        t += 1.0
        batch: list[Action] = []
        landed: dict[str, float] = {}  # RECV action -> when its data is on the device
        loader_at: list[float] = []
        for i, a in enumerate(program):
            if a.is_comm:
                batch.append(a)
                span(f"PP:{a}", t, 3.0)
                last = i + 1 == len(program) or not program[i + 1].is_comm
                if last:
                    nccl_free = _post(op, batch, t + 1.5, pid, nccl_free, grouped, transfer_us,
                                      landed)  # fmt: skip
                    batch = []
                t += 3.5
                if len(loader_at) == 2:
                    loader_at.append(t - 0.2)  # between actions
                continue
            parts = a.compute_parts() if a.kind is Kind.OVERLAP_F_B else [a]
            if len(parts) > 1:  # the fused action's span, each part's own inside it
                span(f"PP:{a}", t, len(parts) * (4.5 + 3.0 * KERNELS + launch_lag_us))
            for part in parts:
                t, dev_free = compute(part, t, dev_free, landed, loader_at)
            t += 0.5 * (len(parts) > 1)
        if loader:
            for at in loader_at:
                op("Memcpy HtoD (Pinned -> Device)", at, loader_tid, at + 4.0, 3.0, 30,
                   cat="gpu_memcpy", synthetic_owner="")  # fmt: skip
        t = max(t, dev_free + 1.0, nccl_free + 1.0)  # the step ends with a device synchronise
        span(f"ProfilerStep#{k}", step_start, t - step_start + 1.0)
        span(f"PP:STEP:{k}", step_start + 0.2, t - step_start)
        t += 2.0
    names = [(pid, f"thread {pid} (python3)")]
    if loader and loader_named:
        names.append((loader_tid, f"thread {loader_tid} (pt_data_loader)"))
    events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                "args": {"name": name}} for tid, name in names]  # fmt: skip
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": rank, "name": "synthetic GPU"}],
        "distributedInfo": {"backend": "nccl", "rank": rank},
        "vpipe": {"device": f"cuda:{rank}", **(meta or {}), "rank": rank},
        "baseTimeNanoseconds": _BASE_NS,
        "traceEvents": events,
    }


def _post(op: Any, batch: list[Action], launch: float, pid: int, free: float, grouped: bool,
          transfer_us: float, landed: dict[str, float]) -> float:  # fmt: skip
    """Launch a batch's NCCL work at ``launch`` (NCCL's stream free from ``free``); note when
    each received message lands; return when the stream is free again."""
    name = "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"
    start = max(launch + 5.0, free)
    groups = [batch] if grouped else [[a] for a in batch]
    for g in groups:
        recvs = [str(a) for a in g if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        end = start + (transfer_us if recvs else 2.0)
        op(name, launch, pid, start, end - start, 20, synthetic_owner="", synthetic_messages=recvs)
        for r in recvs:
            landed[r] = end
        start = end
    return start


def write_nccl_run(
    out_dir: str | Path, programs: Sequence[Sequence[Action]], **kwargs: Any
) -> list[Path]:
    """Write each rank's :func:`nccl_trace` to ``out_dir``; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r, program in enumerate(programs):
        path = out / trace_file_name(r)
        path.write_bytes(orjson.dumps(nccl_trace(program, r, **kwargs), option=orjson.OPT_INDENT_2))
        paths.append(path)
    return paths
