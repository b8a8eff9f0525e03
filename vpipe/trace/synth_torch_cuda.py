"""Synthetic CUDA traces of torch.distributed.pipelining on NCCL, laid out as Kineto writes
them: for tests of the device clock's waits on traces whose runtime marks none.

:func:`torch_cuda_run` runs every rank's lowered program together on a model of the machine
and writes what Kineto would record (``user_annotation`` spans, ``cuda_runtime`` launches
with correlation ids and their ``ac2g`` flows, kernels on streams, thread names,
``distributedInfo``; no vpipe metadata, no ``PP:STEP`` spans):

- **Host**: each rank's thread walks its program and never blocks (NCCL's ``wait()`` makes the
  compute stream wait, not the host). Multi-stage classes (``spans="actions"``) write a
  ``PP:{action}`` span per action: a SEND/RECV span launches its message's NCCL kernel, a
  compute span its kernels. The single-stage classes launch a compute action's receive
  kernel, its compute, then its send's kernel, inside GPipe's ``Forward i`` / ``Backward i``
  span (``spans="gpipe"``) or in no span at all (Schedule1F1B, ``spans="none"``).
- **Device**: a compute stream (7) runs each action's kernels in order, the first one once
  its input's receive kernel has ended; each (peer, direction) has its own NCCL stream. A
  send kernel starts after the compute that produced its data (the NCCL stream waits for the
  compute stream); a send and its receive end together, ``transfer_us`` after both started.
  Backward kernels are launched by autograd's unnamed worker thread.
- **Steps**: ``ProfilerStep#k`` ends after the device's last op (a synchronise).

It returns the documents and what the layout says, per rank: the step ``window_us``, the
``busy_us`` (the union of each compute action's first kernel start to last kernel end) and
each receiving action's ``waits`` (from the later of the device's previous work end and the
action's span start, or its receive's launch where it has no span, to the end of its receive
kernel, never past its first kernel; the rule :mod:`vpipe.trace.device_waits` states).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from vpipe.ir import Action, Kind, Schedule, parse_action
from vpipe.ir.lowering import lower

_BASE_NS = 1_700_000_000_000_000_000
_LAG = 4.0  # a launch's kernel starts no sooner than this after it (us)
_GAP = 3.0  # host time per kernel launch (us)
_NCCL_KERNEL = "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"
_STEP_US = 10_000.0  # where the step starts


def _message(a: Action) -> tuple[str, int, int]:
    """(direction, boundary stage, microbatch) of a SEND/RECV action: a send's and its
    receive's are equal."""
    k = a.kind.value
    return k[-1], a.stage - (k in ("RECV_F", "SEND_B")), a.microbatch


def _recv_of(a: Action) -> str:
    return f"{a.stage}{'RECV_F' if a.kind is Kind.F else 'RECV_B'}{a.microbatch}"


def torch_cuda_run(
    schedule: Schedule,
    *,
    spans: str = "actions",
    kernel_us: Mapping[int, float] | None = None,
    kernels: int = 3,
    transfer_us: float = 15.0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each rank's Kineto document and the layout's figures (module docstring).
    ``kernel_us`` maps a stage to its kernels' length (default 20 us)."""
    program = lower(schedule)
    n = len(program.actions)
    dur = {s: (kernel_us or {}).get(s, 20.0) for s in range(schedule.n_stages)}
    if spans not in ("actions", "gpipe", "none"):
        raise ValueError(f"spans={spans!r}: one of actions, gpipe, none")
    if any(a.kind is Kind.OVERLAP_F_B for acts in program.actions for a in acts):
        raise ValueError(f"{schedule.name}: overlap actions are not laid out")
    laid = [_host(acts, r, spans, kernels) for r, acts in enumerate(program.actions)]
    ev, launches = [e for e, _ in laid], [k for _, k in laid]
    _device(launches, dur, transfer_us)
    corr = 0
    docs, truth = [], []
    for r in range(n):
        pid = 3000 + r
        for k in launches[r]:
            corr += 1
            c, (d0, d1) = corr, k["dev"]
            kname, call = (f"kernel_{k['action']}_{k['j']}", "cudaLaunchKernel") if k["kind"] == (
                "kernel") else (_NCCL_KERNEL, "cudaLaunchKernelExC")  # NCCL launches so  # fmt: skip
            ev[r] += [
                {"ph": "X", "cat": "cuda_runtime", "name": call, "pid": pid,
                 "tid": k["tid"], "ts": round(k["launch"], 3), "dur": 2.0,
                 "args": {"correlation": c}},
                {"ph": "X", "cat": "kernel", "name": kname, "pid": r, "tid": k["stream"],
                 "ts": round(d0, 3), "dur": round(d1 - d0, 3),
                 "args": {"device": r, "stream": k["stream"], "correlation": c}},
                {"ph": "s", "cat": "ac2g", "id": c, "pid": pid, "tid": k["tid"],
                 "ts": round(k["launch"], 3), "name": "ac2g"},
                {"ph": "f", "cat": "ac2g", "id": c, "pid": r, "tid": k["stream"],
                 "ts": round(d0, 3), "name": "ac2g", "bp": "e"},
            ]  # fmt: skip
        host_end = max(e["ts"] + e.get("dur", 0) for e in ev[r])
        end = max(host_end, max(k["dev"][1] for k in launches[r])) + 2.0
        ev[r].append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": pid,
                      "tid": pid, "ts": _STEP_US, "dur": end - _STEP_US, "args": {}})  # fmt: skip
        ev[r] += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                   "args": {"name": nm}} for tid, nm in
                  ((pid, f"thread {pid} (python3)"), (pid + 50_000, f"thread {pid + 50_000} (python3)"))]  # fmt: skip
        docs.append({
            "schemaVersion": 1,
            "deviceProperties": [{"id": r, "name": "synthetic GPU"}],
            "distributedInfo": {"backend": "nccl", "rank": r, "world_size": n},
            "baseTimeNanoseconds": _BASE_NS,
            "traceEvents": ev[r],
        })  # fmt: skip
        truth.append(_truth(ev[r], launches[r], end - _STEP_US))
    return docs, truth


def _host(
    acts: list[Action], r: int, spans: str, kernels: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One rank's spans and launches (device times come later), as the module docstring
    lays them out."""
    pid, t = 3000 + r, _STEP_US + 1.0 + 0.5 * r
    events: list[dict[str, Any]] = []
    launches: list[dict[str, Any]] = []
    pending_recv: dict[str, Action] = {}
    single = spans != "actions"
    prev = ""  # the last compute action: a send's data is its output

    def span(name: str, start: float, length: float) -> None:
        events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": pid,
                       "tid": pid, "ts": round(start, 3), "dur": round(length, 3), "args": {}})  # fmt: skip

    def nccl(at: float, a: Action, send: bool) -> None:
        launches.append({"kind": "nccl", "launch": at, "tid": pid, "msg": _message(a),
                         "send": send, "after": prev if send else None, "name": str(a)})  # fmt: skip

    for a in acts:
        send = a.kind in (Kind.SEND_F, Kind.SEND_B)
        if a.is_comm and single:
            if send:  # inside the span of the compute before it
                nccl(t - 1.0, a, True)
            else:  # posted inside its consumer's span
                pending_recv[str(a)] = a
            continue
        if a.is_comm:
            span(f"PP:{a}", t, 3.0)
            nccl(t + 1.0, a, send)
            t += 3.5
            continue
        begin = t
        t += 1.0
        got = pending_recv.pop(_recv_of(a), None)
        if got is not None:
            nccl(t, got, False)
            t += _GAP
        for j in range(kernels):
            backward = a.kind is not Kind.F  # autograd's thread launches these
            launches.append({"kind": "kernel", "launch": t, "tid": pid + 50_000 if backward
                             else pid, "action": str(a), "j": j, "stage": a.stage})  # fmt: skip
            t += _GAP
        prev = str(a)
        t += 1.0 + 2.0 * single  # leaves room for a send posted inside the span
        name = f"{'Forward' if a.kind is Kind.F else 'Backward'} {a.microbatch}"
        if spans != "none":
            span(name if single else f"PP:{a}", begin, t - begin)
        t += 0.5
    return events, launches


def _device(
    launches: list[list[dict[str, Any]]], dur: Mapping[int, float], transfer: float
) -> None:
    """Give every launch its stream and device interval ``dev`` (module docstring)."""
    queues: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r, mine in enumerate(launches):
        for k in mine:
            k["stream"] = 7 if k["kind"] == "kernel" else 20 + 2 * (k["msg"][0] == "B") + k["send"]
            queues.setdefault((r, k["stream"]), []).append(k)
    recvs = {(r, k["name"]) for r, mine in enumerate(launches) for k in mine
             if k["kind"] == "nccl" and not k["send"]}  # fmt: skip
    free: dict[tuple[int, int], float] = {}
    done: dict[str, float] = {}  # action -> its last kernel's end
    landed: dict[tuple[int, str], float] = {}  # (rank, RECV action) -> its kernel's end
    started: dict[tuple[tuple, bool], float] = {}  # (message, is send) -> kernel start
    progress = True
    while progress:
        progress = False
        for (r, stream), queue in queues.items():
            while queue:
                k = queue[0]
                ready = max(free.get((r, stream), 0.0), k["launch"] + _LAG)
                if k["kind"] == "kernel":
                    need = (r, _recv_of(parse_action(k["action"])))
                    if k["j"] == 0 and need in recvs:
                        if need not in landed:
                            break
                        ready = max(ready, landed[need])
                    k["dev"] = (ready, ready + dur[k["stage"]])
                    done[k["action"]] = k["dev"][1]
                else:
                    if "start" not in k:
                        if k["after"] is not None and k["after"] not in done:
                            break
                        k["start"] = max(ready, done.get(k["after"], 0.0))
                        started[(k["msg"], k["send"])] = k["start"]
                        progress = True
                    peer = started.get((k["msg"], not k["send"]))
                    if peer is None:
                        break
                    k["dev"] = (k["start"], max(k["start"], peer) + transfer)
                    if not k["send"]:
                        landed[(r, k["name"])] = k["dev"][1]
                free[(r, stream)] = k["dev"][1]
                queue.pop(0)
                progress = True
    stuck = sorted({r for (r, _), q in queues.items() if q})
    if stuck:
        raise ValueError(f"synthetic run hangs on ranks {stuck}")


def _truth(events: list[dict[str, Any]], launches: list[dict[str, Any]], window: float) -> dict:
    """The layout's figures of one rank (module docstring)."""
    spans = {e["name"]: e["ts"] for e in events if e.get("cat") == "user_annotation"}
    by_action: dict[str, list[tuple[float, float]]] = {}
    recv_end: dict[str, float] = {}
    asked: dict[str, float] = {}  # RECV action -> when the host posted it
    for k in launches:
        if k["kind"] == "kernel":
            by_action.setdefault(k["action"], []).append(k["dev"])
        elif not k["send"]:
            recv_end[k["name"]], asked[k["name"]] = k["dev"][1], k["launch"]
    extents = sorted((min(s for s, _ in v), max(e for _, e in v), a) for a, v in by_action.items())
    busy, reach, waits = 0.0, None, {}
    prev_end = -1.0
    for s, e, a in extents:
        act = parse_action(a)
        name = f"PP:{a}" if f"PP:{a}" in spans else (
            f"{'Forward' if act.kind is Kind.F else 'Backward'} {act.microbatch}")  # fmt: skip
        data = recv_end.get(_recv_of(act)) if act.kind is not Kind.W else None
        if data is not None:
            begin = min(max(prev_end, spans.get(name, asked[_recv_of(act)])), s)
            waits[a] = max(0.0, min(data, s) - begin)
        busy += max(0.0, e - max(s, reach if reach is not None else s))
        reach = e if reach is None else max(reach, e)
        prev_end = max(prev_end, e)
    return {"window_us": window, "busy_us": busy, "waits": waits}


def write_torch_cuda_run(out_dir: str | Path, schedule: Schedule, **kwargs: Any) -> list[dict]:
    """Write :func:`torch_cuda_run`'s documents as ``rank<N>_trace.json`` in ``out_dir``
    (torchtitan's names); return the layout's figures per rank."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs, truth = torch_cuda_run(schedule, **kwargs)
    for r, doc in enumerate(docs):
        (out / f"rank{r}_trace.json").write_bytes(orjson.dumps(doc))
    return truth
