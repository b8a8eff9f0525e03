"""Read a Kineto JSON trace file, keeping only what vpipe converts, fast.

A 30 MB CPU trace holds ~100k events of which vpipe needs the ``PP:`` spans, ``ProfilerStep#``
spans and ``[memory]`` instant events, and, for traces that do not mark their waits (torch's
runtime), each CPU operator's thread, start and length (read by one regular expression over the
bytes on the fast path, the full parse where one is laid out otherwise). A CUDA trace adds
the GPU's activity: every kernel, copy and memset (stream, correlation id) and the host calls
that launched them (thread, correlation id), which :mod:`vpipe.trace.device_clock` joins to
put each action on the device's clock.
CUDA traces are read by the *full parse* (below): their GPU ops have arbitrary names (C++
templates with braces), which the fast path's slicing does not handle. Parsing every event into
Python dicts dominates the conversion time of a CPU trace, so :func:`read_trace` first tries a
*fast path* on those: it finds the wanted spans by
their ``"name"`` with a regular expression over the raw bytes, slices each one out (objects
nested at most one level, as Kineto writes them) and parses only those slices. ``[memory]``
events, when there are any, come from arrow's JSON reader, which parses the whole file but
builds only their name, ts and args fields as columns (any key order). Anything unexpected
(unbalanced braces, NUL bytes, a file not ending in ``}``, an event slice that does not parse,
JSON arrow rejects, a [memory] event lacking a field) falls back to the *full parse* with
orjson, which either succeeds or raises a TraceError naming the file, line, column and byte of
the damage. So truncated and corrupt files are always reported; without [memory] events,
corruption that keeps the JSON structure balanced and lies outside the wanted events can go
unnoticed by the fast path, and does not affect the result.
"""

from __future__ import annotations

import gc
import gzip
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from vpipe.errors import TraceError

_MEMORY_ARGS = {
    "alloc": "Total Allocated",
    "reserved": "Total Reserved",
    "device": "Device Type",
    "device_id": "Device Id",
}
# The fields vpipe reads from each event; arrow skips the rest (and checks the whole file parses).
_MEMORY_EVENTS = pa.schema(
    [
        pa.field(
            "traceEvents",
            pa.list_(
                pa.struct(
                    [("name", pa.string()), ("ts", pa.float64())]
                    + [("args", pa.struct([(f, pa.int64()) for f in _MEMORY_ARGS.values()]))]
                )
            ),
        )
    ]
)
# Kineto's device-side copy of a record_function range (on CUDA): the same name on a GPU stream.
# Never a row: vpipe times actions by the GPU ops they launched (kernels launched from another
# thread, such as autograd's, get no such copy).
_GPU_COPY = "gpu_user_annotation"
_GPU_OPS = ("kernel", "gpu_memcpy", "gpu_memset")  # work the device ran, with its launch's id
_LAUNCHES = ("cuda_runtime", "cuda_driver")  # host calls; those that launched an op share its id
_CUDA_ACTIVITY = re.compile(rb'"cat"\s*:\s*"(?:kernel|gpu_memcpy|gpu_memset)"')
_SPAN_NAME = re.compile(rb'"name"\s*:\s*"(PP:|ProfilerStep#|Forward \d|Backward \d)')
# torch's single-stage schedules name their actions "Forward i" / "Backward i".
_SPAN_PREFIXES = ("PP:", "ProfilerStep#", "Forward ", "Backward ")
# A CPU operator as Kineto writes it (keys in this order); the fast path reads these fields only.
_CPU_OP = re.compile(
    rb'"cat":\s*"cpu_op",\s*"name":\s*"((?:[^"\\]|\\.)*)",\s*"pid":\s*-?\d+,\s*'
    rb'"tid":\s*(-?\d+),\s*"ts":\s*([-+\d.eE]+),\s*"dur":\s*([-+\d.eE]+)'
)
# Operators that move data between ranks or wait for it: never the rank's computing.
_COMM_OP = re.compile(r"c10d::|gloo:|nccl|record_param_comms", re.IGNORECASE)
_BACKWARD_OP = "autograd::engine::evaluate_function"  # a backward node run by autograd
_OBJECT_TAIL = re.compile(rb"[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")


class NotATrace(TraceError):
    """A file that parses but is not a profiler trace (wrong shape, no events)."""


@dataclass
class RawTrace:
    """What vpipe needs from one trace file."""

    header: dict[str, Any]  # the top-level keys except traceEvents
    spans: dict[str, list]  # name, ts, dur (microseconds), tid of complete CPU-side PP: /
    # ProfilerStep# / Forward i / Backward i spans (not their GPU-stream copies)
    memory: dict[str, np.ndarray]  # ts, alloc, reserved, device of [memory] events
    n_events: int  # events in the file (for speed figures)
    gpu: GpuActivity = field(default_factory=lambda: GpuActivity())  # empty on CPU traces
    ops: dict[str, np.ndarray] = field(default_factory=lambda: _ops_arrays([], [], [], []))
    # ts, dur (microseconds), tid, comm (a communication call) and backward (an autograd
    # engine's step) of the CPU operators


@dataclass
class GpuActivity:
    """A CUDA trace's device work and the host calls that launched it, as Kineto writes them
    (microseconds on the trace's clock). Ops and launches pair up by ``correlation``."""

    op_ts: list[float] = field(default_factory=list)
    op_dur: list[float] = field(default_factory=list)
    op_correlation: list[int] = field(default_factory=list)
    op_stream: list[int] = field(default_factory=list)
    op_is_nccl: list[bool] = field(default_factory=list)  # a collective's or p2p's own kernel
    launch_ts: list[float] = field(default_factory=list)
    launch_tid: list[int] = field(default_factory=list)
    launch_correlation: list[int] = field(default_factory=list)
    thread_names: dict[int, str] = field(default_factory=dict)  # tid -> name, where written

    def __len__(self) -> int:
        return len(self.op_ts)


def _no_spans() -> dict[str, list]:
    return {"name": [], "ts": [], "dur": [], "tid": []}


def _tid(v: Any) -> int:
    """A thread id as Kineto writes it (an int; a name for the profiler's own rows: -1)."""
    return v if isinstance(v, int) else -1


def is_comm_op(name: str) -> bool:
    """Whether a CPU operator is a communication call (posting, sending or waiting for data)."""
    return _COMM_OP.match(name) is not None


def _ops_arrays(names: list, ts: list, dur: list, tid: list) -> dict[str, np.ndarray]:
    """The operator columns; ``comm`` and ``backward`` decided once per distinct name."""
    text = {n: n.decode() if isinstance(n, bytes) else n for n in set(names)}
    comm = {n: is_comm_op(t) for n, t in text.items()}
    backward = {n: t.startswith(_BACKWARD_OP) for n, t in text.items()}
    return {
        "ts": np.asarray(ts, np.float64),
        "dur": np.asarray(dur, np.float64),
        "tid": np.asarray(tid, np.int64),
        "comm": np.fromiter((comm[n] for n in names), bool, len(names)),
        "backward": np.fromiter((backward[n] for n in names), bool, len(names)),
    }


def read_trace(path: str | Path) -> RawTrace:
    """Read one trace file (``.json`` or ``.json.gz``); TraceError names the file on damage."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as e:
        raise TraceError(f"{path}: cannot read trace: {e}") from None
    gc_was_on = gc.isenabled()
    gc.disable()  # many fresh containers and no cycles: collection passes are pure waste
    try:
        cuda = _CUDA_ACTIVITY.search(raw) is not None
        return (None if cuda else _fast(raw, path)) or _full(raw, path)
    finally:
        if gc_was_on:
            gc.enable()


def _full(raw: bytes, path: Path) -> RawTrace:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        what = "truncated" if e.pos >= len(raw.rstrip()) - 1 else "corrupt"
        raise TraceError(
            f"{path}: {what} trace JSON at line {e.lineno}, column {e.colno} (byte {e.pos}): {e.msg}"
        ) from None
    if isinstance(doc, list):  # Chrome's bare array form
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise NotATrace(f"{path}: not a Kineto/Chrome trace: no 'traceEvents' list")
    events = doc.pop("traceEvents")
    if not any(isinstance(e, dict) and "ph" in e for e in events):
        raise NotATrace(f"{path}: not a trace: its 'traceEvents' hold no trace events")
    wanted, gpu = [], GpuActivity()
    ops: tuple[list, list, list, list] = ([], [], [], [])
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            continue
        name, cat = e.get("name"), e.get("cat")
        if cat in _GPU_OPS or cat in _LAUNCHES or (e.get("ph") == "M" and name == "thread_name"):
            _add_gpu_event(gpu, i, e, path)
        elif cat == "cpu_op" and e.get("ph") == "X":
            try:
                row = (str(name), float(e["ts"]), float(e["dur"]), int(e["tid"]))
                for col, v in zip(ops, row, strict=True):
                    col.append(v)
            except (KeyError, TypeError, ValueError) as err:
                raise TraceError(
                    f"{path}: malformed trace event #{i} ({name!r}): {err!r}"
                ) from None
        elif isinstance(name, str) and name.startswith((*_SPAN_PREFIXES, "[memory]")):
            wanted.append((i, e))
    spans, memory = _pick(wanted, path)
    return RawTrace(doc, spans, memory, len(events), gpu, _ops_arrays(*ops))


def _add_gpu_event(gpu: GpuActivity, i: int, e: dict, path: Path) -> None:
    """Add one GPU op, launch call or thread name to ``gpu``; TraceError on a malformed one."""
    try:
        cat, args = e.get("cat"), e.get("args") or {}
        if e.get("ph") == "M":
            gpu.thread_names[int(e["tid"])] = str(args.get("name", ""))
        elif cat in _GPU_OPS:
            gpu.op_ts.append(float(e["ts"]))
            gpu.op_dur.append(float(e["dur"]))
            gpu.op_correlation.append(int(args["correlation"]))
            gpu.op_stream.append(int(args.get("stream", -1)))
            gpu.op_is_nccl.append(str(e.get("name", "")).lower().startswith("nccl"))
        elif "correlation" in args:  # a launch call (others, e.g. a synchronise, have id 0)
            gpu.launch_ts.append(float(e["ts"]))
            gpu.launch_tid.append(int(e["tid"]))
            gpu.launch_correlation.append(int(args["correlation"]))
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise TraceError(f"{path}: malformed trace event #{i} ({e.get('name')!r}): {err!r}") from None


def _pick(events: list[tuple[int, dict]], path: Path) -> tuple[dict[str, list], dict]:
    spans = _no_spans()
    mem: dict[str, list] = {"ts": [], **{k: [] for k in _MEMORY_ARGS}}
    for i, e in events:
        try:
            name = e["name"]
            if name == "[memory]":
                a = e["args"]
                mem["ts"].append(float(e["ts"]))
                mem["alloc"].append(int(a.get("Total Allocated", 0)))
                mem["reserved"].append(int(a.get("Total Reserved", 0)))
                mem["device"].append(int(a.get("Device Type", 0)))
                mem["device_id"].append(int(a.get("Device Id", -1)))
            elif e.get("ph") == "X" and e.get("cat") not in (_GPU_COPY, "cpu_op"):
                spans["name"].append(name)
                spans["ts"].append(float(e["ts"]))
                spans["dur"].append(float(e["dur"]))
                spans["tid"].append(_tid(e.get("tid")))
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise TraceError(
                f"{path}: malformed trace event #{i} ({e.get('name')!r}): {err!r}"
            ) from None
    return (
        spans,
        {
            "ts": np.asarray(mem["ts"], np.float64),
            **{k: np.asarray(mem[k], np.int64) for k in _MEMORY_ARGS},
        },
    )


def _fast(raw: bytes, path: Path) -> RawTrace | None:
    """The fast path; None whenever the file does not look exactly as expected."""
    body = raw.rstrip()
    key = raw.find(b'"traceEvents"')
    end = body.rfind(b"]")
    if not body.endswith(b"}") or key < 0 or end < key:
        return None
    try:
        header = orjson.loads(raw[:key] + b'"traceEvents": 0}')
        after = body[end + 1 : -1].strip().lstrip(b",")
        if after.strip():
            header.update(orjson.loads(b"{" + after + b"}"))
        del header["traceEvents"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if raw.find(b'"[memory]', key) >= 0:
        found = _memory(raw)
        if found is None:
            return None
        memory, n_events = found
    elif b"\x00" in raw or raw.count(b"{") != raw.count(b"}"):
        return None
    else:
        memory = {"ts": np.zeros(0), **{k: np.zeros(0, np.int64) for k in _MEMORY_ARGS}}
        n_events = raw.count(b'"ph"')
    if not n_events:
        return None  # the full parse says what the file is instead
    span_slices = []
    for m in _SPAN_NAME.finditer(raw, key):
        start = raw.rfind(b"{", key, m.start())
        if start < 0 or raw.find(b"}", start, m.start()) >= 0:
            return None  # an object nested before "name": not the layout we slice
        tail = _OBJECT_TAIL.match(raw, m.end())
        if tail is None:
            return None
        span_slices.append(raw[start : tail.end()])
    try:
        events = orjson.loads(b"[" + b",".join(span_slices) + b"]")
    except orjson.JSONDecodeError:
        return None
    spans, _ = _pick(list(enumerate(events)), path)
    found = _CPU_OP.findall(raw, key)
    if len(found) != raw.count(b'"cpu_op"', key):
        return None  # an operator not laid out as expected: the full parse reads it
    names, tid, ts, dur = zip(*found, strict=True) if found else ((), (), (), ())
    return RawTrace(header, spans, memory, n_events, ops=_ops_arrays(list(names), ts, dur, tid))


def _memory(raw: bytes) -> tuple[dict[str, np.ndarray], int] | None:
    """The [memory] columns and the event count, by arrow's JSON reader (which parses the whole
    file but builds only these fields); None if anything is missing or off."""
    try:
        table = pj.read_json(
            io.BytesIO(raw),
            read_options=pj.ReadOptions(use_threads=False, block_size=len(raw) + 1),
            parse_options=pj.ParseOptions(
                explicit_schema=_MEMORY_EVENTS,
                unexpected_field_behavior="ignore",
                newlines_in_values=True,
            ),
        )
    except pa.ArrowException:
        return None
    col = table.column("traceEvents")
    if table.num_rows != 1 or col.null_count:
        return None
    name, ts, args = col.chunk(0).flatten().flatten()  # a null event has null fields
    is_memory = pc.equal(name, "[memory]")
    cols = [pc.filter(a, is_memory) for a in (ts, *args.flatten())]
    if any(a.null_count for a in cols) or pc.sum(pc.starts_with(name, "[memory]")).as_py() != len(
        cols[0]
    ):
        return None  # a missing field (the full parse decides) or a span named [memory]...
    return {k: np.array(a) for k, a in zip(("ts", *_MEMORY_ARGS), cols, strict=True)}, len(name)
