"""Kineto (torch.profiler) JSON traces -> the vpipe event and memory tables.

What becomes a row of the event table (:mod:`vpipe.events` schema, ``source="measured"``):

- ``PP:{action}`` spans (vpipe's runtime and torch.distributed.pipelining both name executed
  actions so): ``kind``, ``stage`` and ``microbatch`` from the action string, ``name`` the action
  string (``2F3``). An overlap action ``PP:(0F3;3B1)OVERLAP_F_B`` becomes one row per compute
  part, each with the compound's interval (its parts' split is not observable) and the compound
  string as ``name``; where the trace also has the parts' own ``PP:`` spans inside it, those
  rows are used instead. So every executed plain compute action has exactly one compute row.
- ``PP:WAIT:{comm action}`` spans: ``kind="WAIT"`` with the stage and microbatch of that comm
  action, ``name="WAIT:{comm action}"``. vpipe's runtime waits for an action's inputs inside
  the action's span; a compute row starts where the WAIT spans nested in it end, so compute
  rows hold computing only (the raw span start is lost; the WAIT row keeps the wait).
- Step spans, ``PP:STEP:{k}`` (vpipe's ``Pipeline.step``) or else ``ProfilerStep#N`` (the
  profiler's own, e.g. for torch.distributed.pipelining programs): ``kind="other"``,
  ``name="STEP"``, step k or N. Every row's ``step`` is the step span that contains its start,
  per rank; rows outside every step span are dropped. A trace with neither is one step, 0.
- ``PP:{stage}REDUCE{bucket}`` spans (data parallel, :mod:`vpipe.ir.reduction`): ``kind="REDUCE"``
  with the stage and the bucket as ``microbatch``, from the reduction's start to its completion;
  ``PP:WAIT:{stage}REDUCE{bucket}``: a WAIT row, the step's end waiting for it.
- Other ``PP:`` spans (e.g. torch's ``PP:0UNSHARD``): ``kind="other"``, stage/microbatch -1.
- torch's single-stage schedules' ``Forward i`` / ``Backward i`` spans: F / B of the rank's
  one stage, microbatch i.

Traces without vpipe's step and WAIT spans (torch.distributed.pipelining's, which waits for an
action's inputs inside the action's span) are read by their CPU operators where they hold them
(:mod:`vpipe.trace.operators`): a compute row runs from its first operator to its last, the
lead-in is a WAIT row; a rank naming no actions gets runs of operators. Their metadata (ranks,
program, stages, microbatches, schedule) comes from the trace (:mod:`vpipe.trace.infer`);
which files are traces and whether they agree: :mod:`vpipe.trace.files`.

Rows come from the CPU-side spans, one per span. On CUDA the trace also holds the GPU's
work (kernels, copies, memsets, each with the host call that launched it): each compute row
takes the interval of the GPU work its span launched, from any thread, WAIT rows the device's
wait for their data (found from the receives' NCCL kernels where the runtime marks no waits:
:mod:`vpipe.trace.device_waits`) and REDUCE rows their all-reduce kernel (:mod:`vpipe.trace.device_clock`;
``clock="device"``, the CPU span kept as the row's launch span). Kineto's
``gpu_user_annotation`` copies of the spans never make rows. Without GPU activity every row is
on the host clock (``clock="host"``, launch span = the row's span); a CUDA trace (the run's
``device`` metadata, else the trace's GPU ``deviceProperties``) without it converts with a
warning that its times are launch times. The run's ``meta["clock"]`` says which (``mixed`` if
ranks differ).

Times are wall-clock nanoseconds (Kineto's ``baseTimeNanoseconds`` + ``ts``), comparable across
the ranks of one host; ranks whose messages show their clocks apart (several hosts) are put on
one clock (:mod:`vpipe.trace.clock_offsets`).

Memory table rows: ``[memory]`` instant events (``profile_memory=True``) give ``what`` =
``cpu_allocated`` or ``cuda_allocated`` (allocator's bytes in use after each allocation or
free) and ``cuda_reserved``; :class:`vpipe.trace.record.StepProfiler`'s per-step samples add
``rss``, ``cuda_peak`` and whatever the caller passed (``activations``: the runtime's live
activation bytes). Each sample's step is the last step span that started before it.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from vpipe.errors import ScheduleError, TraceError
from vpipe.events import (
    COMPUTE_KINDS,
    EVENT_COLUMNS,
    MEMORY_COLUMNS,
    events_frame,
    memory_frame,
)
from vpipe.ir import Kind, parse_action
from vpipe.ir.reduction import parse_reduce
from vpipe.trace.clock_offsets import align_clocks
from vpipe.trace.device_clock import SPAN, gpu_ops, to_device_clock
from vpipe.trace.files import by_rank, check_steps, merged_meta, read_traces, world_size
from vpipe.trace.infer import inferred_meta
from vpipe.trace.kineto_json import RawTrace
from vpipe.trace.operators import no_actions_note, read_by_operators
from vpipe.trace.pipelines import by_stages, from_headers, pick
from vpipe.trace.run_actions import name_runs

_STEP_MARK, _PROF_STEP_MARK = "STEP", "PROFSTEP"
_SINGLE_STAGE = re.compile(r"(Forward|Backward) (\d+)")
_OWN_STAGE = -2  # the stage of a single-stage schedule's span: the rank's


@dataclass
class Trace:
    """A converted trace: the event table, the memory table and the run metadata."""

    events: pd.DataFrame
    memory: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    n_trace_events: int = 0  # events in the JSON files (for speed figures)


def _classify(name: str) -> tuple[str, int, int, str, tuple]:
    """(kind, stage, microbatch, row name, overlap parts) of one span name."""
    if name.startswith("ProfilerStep#") and name[13:].isdigit():
        return _PROF_STEP_MARK, -1, int(name[13:]), "STEP", ()
    single = _SINGLE_STAGE.fullmatch(name)
    if single:  # torch's single-stage classes: the rank's one stage, filled in per file
        return single[1][0], _OWN_STAGE, int(single[2]), name, ()
    body = name[3:] if name.startswith("PP:") else name
    if body.startswith("STEP:") and body[5:].isdigit():
        return _STEP_MARK, -1, int(body[5:]), "STEP", ()
    reduce = parse_reduce(body.removeprefix("WAIT:"))
    if reduce is not None:  # a data-parallel gradient reduction (vpipe.ir.reduction)
        return ("WAIT" if body.startswith("WAIT:") else "REDUCE"), *reduce, body, ()
    try:
        if body.startswith("WAIT:"):
            a = parse_action(body[5:])
            return "WAIT", a.stage, a.microbatch, body, ()
        a = parse_action(body)
    except (ScheduleError, ValueError):
        return "other", -1, -1, body, ()
    if a.kind is Kind.OVERLAP_F_B:
        return (
            "overlap",
            -1,
            -1,
            body,
            tuple((p.kind.value, p.stage, p.microbatch) for p in a.parts),
        )
    return a.kind.value, a.stage, a.microbatch, body, ()


def _to_ns(ts: Sequence[float], base: int) -> np.ndarray:
    return base + np.rint(np.asarray(ts, dtype=np.float64) * 1000.0).astype(np.int64)


def _assign_steps(starts: np.ndarray, marks: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Step of each start by containment in a step span; (steps, inside mask)."""
    if marks.empty:
        return np.zeros(len(starts), np.int64), np.ones(len(starts), bool)
    m = marks.sort_values("start_ns")
    ms, me, mk = (m[c].to_numpy() for c in ("start_ns", "end_ns", "step"))
    idx = np.searchsorted(ms, starts, side="right") - 1
    ok = idx >= 0
    safe = np.where(ok, idx, 0)
    ok &= starts < me[safe]
    return mk[safe], ok


def _convert_file(raw: RawTrace, rank: int) -> tuple[pd.DataFrame, pd.DataFrame, bool, str, bool]:
    """(events, memory, whether it has vpipe's step spans, the clock of its compute rows,
    whether it names its actions)."""
    base = int(raw.header.get("baseTimeNanoseconds") or 0)
    spans = raw.spans
    names = pd.Categorical(spans["name"])
    table = [_classify(n) for n in names.categories]
    codes = names.codes
    kinds = np.array([t[0] for t in table] + ["x"], dtype=object)[codes]
    df = pd.DataFrame(
        {
            "kind": kinds,
            "stage": np.array([t[1] for t in table] + [0], np.int64)[codes],
            "microbatch": np.array([t[2] for t in table] + [0], np.int64)[codes],
            "name": np.array([t[3] for t in table] + [""], dtype=object)[codes],
            "start_ns": _to_ns(spans["ts"], base),
        }
    )
    df["end_ns"] = df["start_ns"] + np.rint(np.asarray(spans["dur"]) * 1000.0).astype(np.int64)
    df[SPAN] = np.arange(len(df))
    df["tid"] = np.asarray(spans["tid"], np.int64)
    own = df["stage"] == _OWN_STAGE
    if own.any():
        df.loc[own, "stage"] = rank
        df.loc[own, "name"] = [
            f"{rank}{k}{m}"
            for k, m in zip(df.loc[own, "kind"], df.loc[own, "microbatch"], strict=True)
        ]
    raw_spans = df[["name", "start_ns", "end_ns", "tid"]].assign(name=list(spans["name"]))
    parts_of = {t[3]: t[4] for t in table if t[0] == "overlap"}

    # Step spans: vpipe's own if present, else the profiler's.
    is_vstep, is_pstep = df["kind"] == _STEP_MARK, df["kind"] == _PROF_STEP_MARK
    marks = df[is_vstep] if is_vstep.any() else df[is_pstep]
    rest = df[~(is_vstep | is_pstep)]
    marks = marks.assign(kind="other", step=marks["microbatch"], microbatch=-1)
    df = pd.concat([marks.assign(part=False), _expand_overlaps(rest, parts_of)], ignore_index=True)
    steps, inside = _assign_steps(df["start_ns"].to_numpy(), marks)
    df["step"] = steps
    df = _trim_nested_waits(_drop_shadowed_parts(df[inside]))
    ops = gpu_ops(raw.gpu, base) if len(raw.gpu) else None
    named = True
    if ops is not None and len(ops):
        named = bool(df["kind"].isin(COMPUTE_KINDS).any())
        df = to_device_clock(df.drop(columns="tid"), raw_spans, ops, raw.gpu.thread_names, rank)
        clock = "device"
    else:
        df, clock = df.drop(columns=SPAN), "host"
        if len(raw.ops["ts"]) and not is_vstep.any() and not (df["kind"] == "WAIT").any():
            # not vpipe's runtime (its WAIT spans say where it waited): read the operators
            df, named = read_by_operators(df, raw.ops, base, rank)
        df = df.drop(columns="tid").assign(
            clock="host",
            launch_start_ns=df["start_ns"],
            launch_end_ns=df["end_ns"],
            busy_ns=df["busy_ns"] if "busy_ns" in df else df["end_ns"] - df["start_ns"],
        )
    df["rank"] = rank

    mdf = _memory_rows(
        raw.memory, raw.header.get("vpipe_samples") or [], base, _device_index(raw.header)
    )
    mdf["step"] = _last_started(mdf["t_ns"].to_numpy(), marks)
    mdf["rank"] = rank
    return df, mdf, bool(is_vstep.any()), clock, named


def _last_started(times: np.ndarray, marks: pd.DataFrame) -> np.ndarray:
    """Step of the last step span started at or before each time (-1 before the first)."""
    if marks.empty:
        return np.zeros(len(times), np.int64)
    m = marks.sort_values("start_ns")
    idx = np.searchsorted(m["start_ns"].to_numpy(), times, side="right") - 1
    return np.where(idx >= 0, m["step"].to_numpy()[np.maximum(idx, 0)], -1)


def _expand_overlaps(df: pd.DataFrame, parts_of: Mapping[str, tuple]) -> pd.DataFrame:
    """One row per compute part of each overlap span, flagged ``part=True``."""
    df = df.assign(part=False)
    ov = df["kind"] == "overlap"
    if not ov.any():
        return df
    rows = []
    for name, group in df[ov].groupby("name", sort=False):
        for kind, stage, mb in parts_of[name]:
            rows.append(group.assign(kind=kind, stage=stage, microbatch=mb, part=True))
    return pd.concat([df[~ov], *rows], ignore_index=True)


def _drop_shadowed_parts(df: pd.DataFrame) -> pd.DataFrame:
    """Drop overlap-part rows whose action also has its own span in the same step."""
    if not df["part"].any():
        return df.drop(columns="part")
    key = ["step", "stage", "microbatch", "kind"]
    own = df.loc[~df["part"], key].drop_duplicates()
    merged = df.merge(own.assign(_own=True), on=key, how="left")
    keep = ~(merged["part"].to_numpy() & merged["_own"].fillna(False).to_numpy(bool))
    return df[keep].drop(columns="part")


def _trim_nested_waits(df: pd.DataFrame) -> pd.DataFrame:
    """Start each compute span after the WAIT spans nested in it: the runtime waits for an
    action's inputs inside the action's span, and waiting is not computing. An overlap
    action's parts wait one after another inside its one span, so its rows are split there
    (:func:`_split_compound`)."""
    compute = df["kind"].isin(COMPUTE_KINDS)
    waits = df.loc[df["kind"] == "WAIT"].sort_values("start_ns")
    if waits.empty or not compute.any():
        return df
    compound = compute & df["name"].astype(str).str.startswith("(")
    plain = compute & ~compound
    df = df.copy()
    spans = df.loc[plain, ["start_ns", "end_ns"]].drop_duplicates().sort_values("start_ns")
    ss, se = spans["start_ns"].to_numpy(), spans["end_ns"].to_numpy()
    ws, we = waits["start_ns"].to_numpy(), waits["end_ns"].to_numpy()
    idx = np.searchsorted(ss, ws, side="right") - 1  # the latest span starting before the wait
    ok = idx >= 0
    idx = np.where(ok, idx, 0)
    ok &= we <= se[idx] if len(se) else np.zeros(len(ws), bool)
    if ok.any():
        new_start = ss.copy()
        np.maximum.at(new_start, idx[ok], we[ok])
        keys = pd.MultiIndex.from_arrays([ss, se])
        pos = keys.get_indexer(pd.MultiIndex.from_arrays([df["start_ns"], df["end_ns"]]))
        hit = plain.to_numpy() & (pos >= 0)
        df.loc[hit, "start_ns"] = new_start[pos[hit]]
    if compound.any():
        _split_compounds(df, compound, waits)
    return df


def _split_compounds(df: pd.DataFrame, compound: pd.Series, waits: pd.DataFrame) -> None:
    """Give each part of an overlap span its own interval, in place: a part starts after the
    WAIT for its input (else where the previous part ended) and ends where a later part's WAIT
    begins (else at the span's end, shared by the parts after the last such WAIT)."""
    ws, we = waits["start_ns"].to_numpy(), waits["end_ns"].to_numpy()
    w_name = waits["name"].astype(str).to_numpy()
    w_key = [
        (int(st), int(mb), "F" if "RECV_F" in n else "B")
        for st, mb, n in zip(waits["stage"], waits["microbatch"], w_name, strict=True)
    ]
    rows = df[compound]
    at, starts, ends = [], [], []
    for (name, s, e), group in rows.groupby(["name", "start_ns", "end_ns"], sort=False):
        lo, hi = np.searchsorted(ws, s, side="left"), np.searchsorted(ws, e, side="right")
        wait_of = {w_key[i]: (ws[i], we[i]) for i in range(lo, hi) if we[i] <= e}
        if not wait_of:
            continue
        parts = [(k, int(st), int(mb)) for k, st, mb in _parts_of(str(name))]
        part_wait = [wait_of.get((st, mb, "F" if k == "F" else "B")) for k, st, mb in parts]
        cursor, interval = s, {}
        for i, (k, st, mb) in enumerate(parts):
            w = part_wait[i]
            start = max(cursor, w[1]) if w is not None else cursor
            later = [x[0] for x in part_wait[i + 1 :] if x is not None]
            end = max(start, min(later)) if later else e
            interval[(k, st, mb)] = (start, end)
            cursor = end if later else start
        for idx, k, st, mb in zip(
            group.index, group["kind"], group["stage"], group["microbatch"], strict=True
        ):
            got = interval.get((str(k), int(st), int(mb)))
            if got is not None:
                at.append(idx)
                starts.append(got[0])
                ends.append(got[1])
    df.loc[at, "start_ns"] = np.asarray(starts, np.int64)
    df.loc[at, "end_ns"] = np.asarray(ends, np.int64)


def _parts_of(name: str) -> list[tuple[str, int, int]]:
    """(kind, stage, microbatch) of an overlap action's parts, in order."""
    return [(p.kind.value, p.stage, p.microbatch) for p in parse_action(name).parts]


def _device_index(header: Mapping[str, Any]) -> int | None:
    """The run's own CUDA device index, from vpipe's metadata (``device_index``, else a
    ``cuda:N`` device); None when it names none."""
    meta = header.get("vpipe")
    if not isinstance(meta, dict):
        return None
    if meta.get("device_index") is not None:
        return int(meta["device_index"])
    device = str(meta.get("device") or "")
    return int(device[5:]) if device.startswith("cuda:") and device[5:].isdigit() else None


def _memory_rows(
    mem: Mapping[str, np.ndarray],
    samples: list[dict[str, Any]],
    base: int,
    device_index: int | None = None,
) -> pd.DataFrame:
    """The memory table's rows of one file: the profiler's allocator events (device ones only
    of ``device_index`` where it is known: a process can touch several devices) and vpipe's
    per-step samples."""
    cuda = np.asarray(mem["device"], np.int64) != 0
    if device_index is not None:
        other = cuda & (np.asarray(mem["device_id"], np.int64) != device_index)
        mem = {k: np.asarray(v)[~other] for k, v in mem.items()}
        cuda = cuda[~other]
    t = _to_ns(mem["ts"], base)
    parts = [
        pd.DataFrame(
            {
                "t_ns": t,
                "bytes": np.asarray(mem["alloc"], np.int64),
                "what": np.where(cuda, "cuda_allocated", "cpu_allocated"),
            }
        ),
        pd.DataFrame(
            {
                "t_ns": t[cuda],
                "bytes": np.asarray(mem["reserved"], np.int64)[cuda],
                "what": "cuda_reserved",
            }
        ),
    ]
    if samples:
        try:
            s = pd.DataFrame(samples)[["t_ns", "bytes", "what"]]
            parts.append(s.astype({"t_ns": "int64", "bytes": "int64", "what": str}))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"malformed vpipe_samples in the trace metadata: {e!r}") from None
    return pd.concat(parts, ignore_index=True)


def convert(
    paths: Iterable[str | os.PathLike[str]],
    *,
    run_id: str | None = None,
    impl: str | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    pipeline: int | None = None,
) -> Trace:
    """Convert the per-rank trace files of one run (files or directories) to tables.

    ``run_id``, ``impl`` and ``schedule`` override the trace's embedded metadata; without
    either, the run id is the directory name, impl is ``vpipe`` when the trace has vpipe's
    ``PP:STEP`` spans and ``torch`` otherwise, and the schedule the catalogue family equal to
    the program the trace ran (``custom`` if none is, ``unknown`` if the trace names no actions).
    ``microbatches``: M of a run whose ranks name no actions (else counted from its runs).
    ``pipeline``: which pipeline of a job that runs several (:mod:`vpipe.trace.pipelines`).
    """
    traces = read_traces(paths)
    files = [p for p, _ in traces]
    ranked = by_rank(traces)
    headers = {r: (path, raw.header) for r, (path, raw) in ranked.items()}
    n_ranks = world_size(headers)
    pipes = from_headers(headers)
    group, pipe_note = pick(pipes, pipeline, len(ranked)) if pipes else (None, None)
    if group is not None:  # one pipeline of several: its files, its ranks
        ranked = {group[g]: v for g, v in ranked.items() if g in group}
        headers = {r: (path, raw.header) for r, (path, raw) in ranked.items()}
    ev_parts, mem_parts, metas = [], [], []
    clocks: set[str] = set()
    unnamed: list[int] = []  # ranks whose actions are not named
    n_raw = sum(raw.n_events for _, raw in traces)
    steps = {}
    for rank, (path, raw) in sorted(ranked.items()):
        try:
            ev, mem, vpipe_steps, clock, named = _convert_file(raw, rank)
        except TraceError as e:
            raise TraceError(f"{path}: {e}") from None
        clocks.add(clock)
        if not named:
            unnamed.append(rank)
        if clock == "host" and _is_cuda_trace(raw.header):
            warnings.warn(
                f"{path}: a CUDA trace without GPU activity (profiled without CUDA activity): "
                "its action times are launch times on the host clock, not device times",
                stacklevel=2,
            )
        ev_parts.append(ev)
        mem_parts.append(mem)
        is_step = (ev["kind"] == "other") & (ev["name"] == "STEP")
        steps[rank] = (path, sorted(int(k) for k in ev.loc[is_step, "step"]))
        meta = raw.header.get("vpipe")
        meta = meta if isinstance(meta, dict) else {}
        metas.append((path, meta, vpipe_steps))
    check_steps(steps)
    events = pd.concat(ev_parts, ignore_index=True).sort_values(["rank", "start_ns", "end_ns"])
    memory = pd.concat(mem_parts, ignore_index=True).sort_values(["rank", "t_ns"], kind="stable")
    if pipes is None:  # no groups in the headers: replicas told apart by their stages
        events, memory, group, pipe_note = by_stages(events, memory, pipeline, len(ranked))
        if group is not None:
            ranked = {group[g]: v for g, v in ranked.items() if g in group}
    if group is not None:
        n_ranks = len(group)
    events, memory, offsets, clock_note = align_clocks(events, memory)
    meta = merged_meta(metas)
    meta["run_id"] = run_id or meta.get("run_id") or files[0].resolve().parent.name
    meta["impl"] = impl or meta.get("impl") or ("vpipe" if all(m[2] for m in metas) else "torch")
    meta["schedule"] = schedule or meta.get("schedule") or "unknown"
    meta["ranks_in_trace"] = sorted(ranked)
    meta["clock"] = clocks.pop() if len(clocks) == 1 else "mixed"
    notes = [n for n in (pipe_note, clock_note) if n]
    if offsets:
        meta["clock_offsets_ns"] = {str(r): o for r, o in offsets.items()}
    if group is not None:
        meta["ranks"] = n_ranks
        meta["global_ranks"] = sorted(group, key=group.get)
    if unnamed:  # runs of operators: actions where they follow a single-stage program
        events, follows, why = name_runs(events, n_ranks or max(ranked) + 1, microbatches)
        notes.append(no_actions_note(sorted(unnamed), follows, why))
    if notes:
        meta["note"] = "; ".join(notes)
    if meta["impl"] != "vpipe":  # what vpipe's metadata would say, from the trace itself
        found = inferred_meta(events, n_ranks)
        if not schedule and meta["schedule"] == "unknown" and "schedule" in found:
            meta["schedule"] = found["schedule"]
        for k, v in found.items():
            meta.setdefault(k, v)
    const = {"run_id": meta["run_id"], "source": "measured"}
    events = events_frame(
        {
            **{c: events[c].to_numpy() for c in EVENT_COLUMNS if c in events},
            **const,
            "impl": meta["impl"],
            "schedule": meta["schedule"],
        }
    )
    memory = memory_frame(
        {**{c: memory[c].to_numpy() for c in MEMORY_COLUMNS if c in memory}, **const}
    )
    return Trace(events.reset_index(drop=True), memory.reset_index(drop=True), meta, n_raw)


def _is_cuda_trace(header: Mapping[str, Any]) -> bool:
    """Whether the run was on CUDA: its vpipe metadata's device, else the trace's GPUs."""
    meta = header.get("vpipe")
    if isinstance(meta, dict) and meta.get("device") is not None:
        return str(meta["device"]).startswith("cuda")
    return bool(header.get("deviceProperties"))
