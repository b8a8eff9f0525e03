"""Read a Kineto JSON trace file, keeping only what vpipe converts, fast.

A 30 MB trace holds ~100k events of which vpipe needs the ``PP:`` spans, ``ProfilerStep#``
spans and ``[memory]`` instant events. Parsing every event into Python dicts dominates the
conversion time, so :func:`read_trace` first tries a *fast path*: it finds the wanted events by
their ``"name"`` with a regular expression over the raw bytes, slices each one out (objects
nested at most one level, as Kineto writes them), parses only those slices, and takes the
``[memory]`` fields with regular expressions. Anything unexpected (unbalanced braces,
NUL bytes, a file not ending in ``}``, an event slice that does not parse, field counts that do
not line up) falls back to the *full parse* with orjson, which either succeeds or raises a
TraceError naming the file, line, column and byte of the damage. So truncated and corrupt files
are always reported; corruption that keeps the JSON structure balanced and lies outside the
wanted events can go unnoticed by the fast path, and does not affect the result.
"""

from __future__ import annotations

import gc
import gzip
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from vpipe.errors import TraceError

_WANTED = re.compile(rb'"name"\s*:\s*"(PP:|ProfilerStep#|\[memory\])')
_SPAN_NAME = re.compile(rb'"name"\s*:\s*"(PP:|ProfilerStep#)')
# A [memory] event laid out as Kineto writes it: name, ..., ts, ..., args with these in order.
_MEMORY_EVENT = re.compile(
    rb'"\[memory\]"[^{}]*?"ts"\s*:\s*([-+0-9.eE]+)[^{}]*\{[^{}]*?'
    rb'"Total Reserved"\s*:\s*(-?\d+)[^{}]*?"Total Allocated"\s*:\s*(-?\d+)[^{}]*?'
    rb'"Device Type"\s*:\s*(-?\d+)[^{}]*\}'
)
_OBJECT_TAIL = re.compile(rb"[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")
_MEM_FIELDS = {
    "ts": re.compile(rb'"ts"\s*:\s*([-+0-9.eE]+)'),
    "alloc": re.compile(rb'"Total Allocated"\s*:\s*(-?\d+)'),
    "reserved": re.compile(rb'"Total Reserved"\s*:\s*(-?\d+)'),
    "device": re.compile(rb'"Device Type"\s*:\s*(-?\d+)'),
}


@dataclass
class RawTrace:
    """What vpipe needs from one trace file."""

    header: dict[str, Any]  # the top-level keys except traceEvents
    spans: dict[str, list]  # name, ts, dur (microseconds) of complete PP: / ProfilerStep# spans
    memory: dict[str, np.ndarray]  # ts, alloc, reserved, device of [memory] events
    n_events: int  # events in the file (for speed figures)


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
        return _fast(raw, path) or _full(raw, path)
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
        raise TraceError(f"{path}: not a Kineto/Chrome trace: no 'traceEvents' list")
    events = doc.pop("traceEvents")
    wanted = []
    for i, e in enumerate(events):
        name = e.get("name") if isinstance(e, dict) else None
        if isinstance(name, str) and name.startswith(("PP:", "ProfilerStep#", "[memory]")):
            wanted.append((i, e))
    spans, memory = _pick(wanted, path)
    return RawTrace(doc, spans, memory, len(events))


def _pick(events: list[tuple[int, dict]], path: Path) -> tuple[dict[str, list], dict]:
    spans: dict[str, list] = {"name": [], "ts": [], "dur": []}
    mem: dict[str, list] = {k: [] for k in _MEM_FIELDS}
    for i, e in events:
        try:
            name = e["name"]
            if name == "[memory]":
                a = e["args"]
                mem["ts"].append(float(e["ts"]))
                mem["alloc"].append(int(a.get("Total Allocated", 0)))
                mem["reserved"].append(int(a.get("Total Reserved", 0)))
                mem["device"].append(int(a.get("Device Type", 0)))
            elif e.get("ph") == "X":
                spans["name"].append(name)
                spans["ts"].append(float(e["ts"]))
                spans["dur"].append(float(e["dur"]))
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise TraceError(
                f"{path}: malformed trace event #{i} ({e.get('name')!r}): {err!r}"
            ) from None
    return spans, {
        "ts": np.asarray(mem["ts"], np.float64),
        **{k: np.asarray(mem[k], np.int64) for k in ("alloc", "reserved", "device")},
    }


def _fast(raw: bytes, path: Path) -> RawTrace | None:
    """The fast path; None whenever the file does not look exactly as expected."""
    body = raw.rstrip()
    if not body.endswith(b"}") or b"\x00" in raw or raw.count(b"{") != raw.count(b"}"):
        return None
    key = raw.find(b'"traceEvents"')
    end = body.rfind(b"]")
    if key < 0 or end < key:
        return None
    try:
        header = orjson.loads(raw[:key] + b'"traceEvents": 0}')
        after = body[end + 1 : -1].strip().lstrip(b",")
        if after.strip():
            header.update(orjson.loads(b"{" + after + b"}"))
        del header["traceEvents"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    # [memory] events in bulk when they all have Kineto's layout, else one slice each
    memory = _memory_bulk(raw, key)
    span_slices, mem_slices = [], []
    for m in (_SPAN_NAME if memory is not None else _WANTED).finditer(raw, key):
        start = raw.rfind(b"{", key, m.start())
        if start < 0 or raw.find(b"}", start, m.start()) >= 0:
            return None  # an object nested before "name": not the layout we slice
        tail = _OBJECT_TAIL.match(raw, m.end())
        if tail is None:
            return None
        (mem_slices if m.group(1) == b"[memory]" else span_slices).append(raw[start : tail.end()])
    try:
        events = orjson.loads(b"[" + b",".join(span_slices) + b"]")
    except orjson.JSONDecodeError:
        return None
    spans, _ = _pick(list(enumerate(events)), path)
    if memory is None:
        memory = _memory_fields(mem_slices)
    if memory is None:
        return None
    return RawTrace(header, spans, memory, raw.count(b'"ph"'))


def _memory_bulk(raw: bytes, start: int) -> dict[str, np.ndarray] | None:
    """All [memory] events by one regex pass; None unless it matched every one of them."""
    found = _MEMORY_EVENT.findall(raw, start)
    if len(found) != raw.count(b'"[memory]"', start):
        return None
    if not found:
        return {
            "ts": np.zeros(0),
            **{k: np.zeros(0, np.int64) for k in ("alloc", "reserved", "device")},
        }
    cols = np.array(found, dtype=bytes)
    try:
        return {
            "ts": cols[:, 0].astype(np.float64),
            "reserved": cols[:, 1].astype(np.int64),
            "alloc": cols[:, 2].astype(np.int64),
            "device": cols[:, 3].astype(np.int64),
        }
    except ValueError:
        return None


def _memory_fields(slices: list[bytes]) -> dict[str, np.ndarray] | None:
    """The [memory] fields of the slices by regex; None unless every slice has each once."""
    blob = b"\n".join(slices)
    found = {k: rx.findall(blob) for k, rx in _MEM_FIELDS.items()}
    if any(len(v) != len(slices) for v in found.values()):
        return None
    try:
        return {
            "ts": np.array(found["ts"], dtype=bytes).astype(np.float64)
            if slices
            else np.zeros(0, np.float64),
            **{
                k: np.array(found[k], dtype=bytes).astype(np.int64)
                if slices
                else np.zeros(0, np.int64)
                for k in ("alloc", "reserved", "device")
            },
        }
    except ValueError:
        return None
