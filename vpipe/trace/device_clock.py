"""Put a CUDA trace's actions on the device's clock, from the GPU work each one launched.

On a GPU the host only enqueues work: a ``PP:{action}`` span on the CPU is the time to launch
the action's kernels, and the host runs ahead of the device until the step's synchronise. What
the device did is in the trace's GPU ops (kernels, copies, memsets), each joined to the host
call that launched it by its correlation id. Kineto's ``gpu_user_annotation`` copy of a span is
not enough: it covers only kernels launched from the span's own thread, and autograd launches
every backward kernel from its worker thread.

**Ownership** (:mod:`vpipe.trace.gpu_owners`). A GPU op belongs to the innermost ``PP:`` span
that holds its launch in time (the latest-starting span open at the launch), when a thread
that works for actions launched it: the spans' own thread, and autograd's workers (the main
thread is blocked inside the action while autograd's thread launches for it). Ops launched by
a communication library's own threads (gloo's, NCCL's) belong to no action; those of any
other thread (a data loader's) are other GPU work. So a ``WAIT`` nested in an action owns
the copy that lands its received data, a ``SEND`` the copy that stages its message, and the
action keeps its computing only. An action's ops on a stream other than the rank's compute
stream are side-stream work, other GPU work too. On NCCL the runtime posts a run of adjacent
communication actions as one batch from the last one's span: a received message's device op
is its batch's NCCL kernel (the grouped kernel, which lands every message of the batch, or the
message's own), whichever span launched it.

**Rows** (one rank's rows are rewritten; ``clock`` says which clock a row is on):

- a compute row (F, B, I, W, an overlap part with its own span) runs from its first op's start
  to its last op's end (``clock="device"``), ``busy_ns`` the union of its ops; its CPU span is
  kept as ``launch_start_ns``/``launch_end_ns``. An action that launched nothing is an
  explicit empty device row (``busy_ns`` 0, start = end) where the device was when the host
  finished it: after the device work launched before (its inputs' copies included), and not
  before the host got there.
- a ``WAIT`` row is the device's wait for the received data: from the later of the device's
  previous work end and the host asking for the data (the WAIT span's start), to the end of the
  data's own device op (the copy its WAIT launched, else its message's NCCL kernel),
  never past the consumer's start; empty where the data was there before. What follows the data until the consumer starts is launch
  lag, not waiting. A WAIT whose data op is unknown ends at the consumer's device start.
  A trace with no ``WAIT`` spans (torch's runtime, which waits inside the consuming action's
  span) gets the same rows, found from the NCCL kernels (:mod:`vpipe.trace.device_waits`).
- a ``REDUCE`` row (data parallel) is its all-reduce kernel on the device, not its enqueue.
- a ``GPU`` row is other GPU work (another thread's ops, an action's side-stream ops), per
  source and step, overlapping ops merged: device busy, no action's.
- every other row (the step span, SEND/RECV posts) stays on the host clock: the step span ends
  after the step's device synchronise, so it covers the device work, and posting is host work.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from vpipe.events import COMM_KINDS, COMPUTE_KINDS
from vpipe.trace.device_runs import device_runs
from vpipe.trace.device_waits import found_device_waits
from vpipe.trace.gpu_owners import action_threads, compute_stream, message_ends
from vpipe.trace.kineto_json import GpuActivity

SPAN = "span_index"  # the column that ties a row to its raw span (its position in the trace)
_COMM_THREADS = ("gloo", "nccl")  # a thread named so belongs to the communication library


def gpu_ops(gpu: GpuActivity, base_ns: int) -> pd.DataFrame:
    """The trace's GPU ops joined to their launches, in launch order: ``start_ns``, ``end_ns``,
    ``launch_ns``, ``nccl``, ``stream``, ``tid`` (the launching thread); ops launched by the communication library's threads (or by no
    recorded call) are left out."""
    ops = pd.DataFrame(
        {
            "correlation": np.asarray(gpu.op_correlation, np.int64),
            "start_ns": _ns(gpu.op_ts, base_ns),
            "nccl": np.asarray(gpu.op_is_nccl, bool),
        }
    )
    ops["end_ns"] = ops["start_ns"] + np.rint(np.asarray(gpu.op_dur) * 1000.0).astype(np.int64)
    ops["stream"] = np.asarray(gpu.op_stream, np.int64)
    comm = {t for t, name in gpu.thread_names.items() if any(c in name.lower() for c in _COMM_THREADS)}
    launches = pd.DataFrame(
        {
            "correlation": np.asarray(gpu.launch_correlation, np.int64),
            "launch_ns": _ns(gpu.launch_ts, base_ns),
            "tid": np.asarray(gpu.launch_tid, np.int64),
        }
    )
    launches = launches[~launches["tid"].isin(comm)].drop_duplicates("correlation")
    joined = ops.merge(launches, on="correlation", how="inner")
    cols = ["start_ns", "end_ns", "launch_ns", "nccl", "stream", "tid"]
    return joined.sort_values("launch_ns", kind="stable")[cols].reset_index(drop=True)


def _ns(ts: list[float], base_ns: int) -> np.ndarray:
    return base_ns + np.rint(np.asarray(ts, np.float64) * 1000.0).astype(np.int64)


def owners(starts: np.ndarray, ends: np.ndarray, at: np.ndarray) -> np.ndarray:
    """For each time in ``at``, the index of the latest-starting interval [start, end] that
    holds it; -1 where none does."""
    order = np.argsort(starts, kind="stable")
    out = np.full(len(at), -1, np.int64)
    open_: list[int] = []
    k = 0
    for j in np.argsort(at, kind="stable"):
        t = at[j]
        while k < len(order) and starts[order[k]] <= t:
            open_.append(int(order[k]))
            k += 1
        open_ = [i for i in open_ if ends[i] >= t]
        if open_:
            out[j] = open_[-1]
    return out


def owned_intervals(ops: pd.DataFrame, owner: np.ndarray, n_spans: int) -> pd.DataFrame:
    """Per span (index 0..n_spans-1): its ops' extent (``dev_start``, ``dev_end``; -1 without
    ops), their union ``busy_ns`` and their count ``n_ops``."""
    out = pd.DataFrame(
        {"dev_start": -1, "dev_end": -1, "busy_ns": 0, "n_ops": 0}, index=range(n_spans)
    )
    mine = ops.assign(owner=owner)[owner >= 0].sort_values(["owner", "start_ns"])
    if mine.empty:
        return out
    g = mine.groupby("owner", sort=False)
    # shifted with an integer fill: a NaN would make the column float64, which rounds
    # nanoseconds since the epoch to a few hundred
    reach = g["end_ns"].cummax().groupby(mine["owner"], sort=False).shift(1, fill_value=-(2**62))
    from_ = np.maximum(mine["start_ns"].to_numpy(), reach.to_numpy(np.int64))
    mine = mine.assign(covered=np.maximum(0, mine["end_ns"].to_numpy() - from_))
    agg = mine.groupby("owner").agg(
        dev_start=("start_ns", "min"),
        dev_end=("end_ns", "max"),
        busy_ns=("covered", "sum"),
        n_ops=("start_ns", "size"),
    )
    out.loc[agg.index, agg.columns] = agg.to_numpy()
    return out


def to_device_clock(
    df: pd.DataFrame,
    spans: pd.DataFrame,
    ops: pd.DataFrame,
    thread_names: dict[int, str] | None = None,
    rank: int = -1,
) -> pd.DataFrame:
    """One rank's rows on the device clock, as the module docstring says.

    ``df`` holds the rows (host intervals, compute rows already trimmed of nested waits) with
    their raw span's index in :data:`SPAN`; ``spans`` the raw spans (``name``, ``start_ns``,
    ``end_ns``, ``tid``, in trace order); ``ops`` :func:`gpu_ops`'s table; ``thread_names``
    the trace's names of threads. Adds ``busy_ns`` and the rows of other GPU work (and a
    rank's runs of ops where it names no actions: :mod:`vpipe.trace.device_runs`, ``rank``
    their stage); drops :data:`SPAN`."""
    s0, s1 = spans["start_ns"].to_numpy(), spans["end_ns"].to_numpy()
    idx = df[SPAN].to_numpy()
    kind = df["kind"].astype(str).to_numpy()
    compute = np.isin(kind, COMPUTE_KINDS)
    is_step = (kind == "other") & (df["name"].astype(str) == "STEP").to_numpy()
    # a rank naming no actions (torch's Schedule1F1B): its steps stand for them
    c_spans = np.unique(idx[compute if compute.any() else is_step])
    launch = ops["launch_ns"].to_numpy()
    tids = ops["tid"].to_numpy()
    span_tids = set(spans["tid"].tolist()) - {-1} if "tid" in spans else set()
    mine = np.isin(tids, list(action_threads(
        tids, launch, span_tids, (s0[c_spans], s1[c_spans]), thread_names or {}
    )))  # fmt: skip
    owner = np.where(mine, owners(s0, s1, launch), -1)
    in_compute = np.isin(owner, c_spans)
    stream = compute_stream(ops, in_compute)
    side = in_compute & (ops["stream"].to_numpy() != stream) & ~ops["nccl"].to_numpy()
    # a compute span's NCCL kernels (torch's GPipe posts its messages inside it): not compute
    own_nccl = in_compute & ops["nccl"].to_numpy()
    dev = owned_intervals(ops, np.where(side | own_nccl, -1, owner), len(spans))
    d0, d1, dbusy = (dev[c].to_numpy() for c in ("dev_start", "dev_end", "busy_ns"))
    has = dev["n_ops"].to_numpy() > 0
    # the device's reach before a launch at t: the latest end of the ops launched before t
    reach = np.maximum.accumulate(np.where(ops["nccl"].to_numpy(), -1, ops["end_ns"].to_numpy()))

    def reach_before(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(launch, t, side="left") - 1
        return np.where(i >= 0, reach[np.maximum(i, 0)] if len(reach) else -1, -1)

    df = df.copy()
    df["launch_start_ns"], df["launch_end_ns"] = s0[idx], s1[idx]
    start, end = df["start_ns"].to_numpy().copy(), df["end_ns"].to_numpy().copy()
    busy = end - start
    clock = np.full(len(df), "host", dtype=object)

    on_ops = (compute | (kind == "REDUCE")) & has[idx]
    start[on_ops], end[on_ops], busy[on_ops] = d0[idx[on_ops]], d1[idx[on_ops]], dbusy[idx[on_ops]]
    empty = compute & ~has[idx]  # launched nothing: an empty row where the device was then
    start[empty] = end[empty] = np.maximum(reach_before(s1[idx[empty]]), s1[idx[empty]])
    busy[empty] = 0
    clock[on_ops | empty] = "device"

    waits = np.flatnonzero(kind == "WAIT")
    if len(waits):
        w = idx[waits]
        data_end = _data_end(w, spans, has, d1, _message_ends(df, spans, owner, ops))
        rows_c = np.flatnonzero(compute)
        at = owners(s0[idx[rows_c]], s1[idx[rows_c]], s0[w]) if len(rows_c) else np.full(len(w), -1)
        consumer_start = np.where(at >= 0, start[rows_c[np.maximum(at, 0)]] if len(rows_c) else -1, -1)
        stop = np.where(data_end >= 0, data_end, consumer_start)
        ok = stop >= 0  # else neither its data nor its consumer ran on the device: host clock
        begin = np.maximum(reach_before(s0[w]), s0[w])
        bounded = consumer_start >= 0
        begin[bounded] = np.minimum(begin, consumer_start)[bounded]
        stop[bounded] = np.minimum(stop, consumer_start)[bounded]
        stop = np.maximum(stop, begin)  # data there before the host asked: no wait
        start[waits[ok]], end[waits[ok]] = begin[ok], stop[ok]
        busy[waits[ok]] = stop[ok] - begin[ok]
        clock[waits[ok]] = "device"
    df["start_ns"], df["end_ns"], df["busy_ns"], df["clock"] = start, end, busy, clock
    if not len(waits):  # a runtime that marks no waits (torch's): found from the NCCL kernels
        df = pd.concat([df, found_device_waits(df[compute], SPAN, spans, ops, owner,
                                               reach_before)], ignore_index=True)  # fmt: skip
    if not compute.any() and is_step.any():
        runs = device_runs(df[is_step], ops[mine & ~side], span_tids, stream, rank)
        df = pd.concat([df, runs.assign(**{SPAN: -1})], ignore_index=True)
    other = ~mine & ~ops["nccl"].to_numpy()
    extra = other_work_rows(df, spans, ops, other, side, owner, thread_names or {})
    return pd.concat([df, extra], ignore_index=True).drop(columns=SPAN)


def _message_ends(
    df: pd.DataFrame, spans: pd.DataFrame, owner: np.ndarray, ops: pd.DataFrame
) -> dict[int, int]:
    """Per RECV span: its message's device end (:func:`gpu_owners.message_ends`), the
    batches being the runs of adjacent communication spans in posting order."""
    acts = df[~df["kind"].astype(str).isin(("WAIT", "other"))].drop_duplicates(SPAN)
    acts = acts.assign(_t=spans["start_ns"].to_numpy()[acts[SPAN].to_numpy()])
    batch_of, is_recv, batch, prev_comm = {}, {}, 0, False
    for span, k in zip(acts.sort_values("_t", kind="stable")[SPAN], acts.sort_values(
            "_t", kind="stable")["kind"].astype(str), strict=True):  # fmt: skip
        comm = k in COMM_KINDS
        if comm:
            batch += not prev_comm
            batch_of[int(span)], is_recv[int(span)] = batch, k.startswith("RECV")
        prev_comm = comm
    return message_ends(batch_of, is_recv, owner, ops)


def other_work_rows(
    df: pd.DataFrame,
    spans: pd.DataFrame,
    ops: pd.DataFrame,
    other: np.ndarray,
    side: np.ndarray,
    owner: np.ndarray,
    thread_names: dict[int, str],
) -> pd.DataFrame:
    """Rows of kind ``GPU`` (other GPU work: device busy, no action's) for the ops of other
    threads and the side-stream ops of actions, per step and source, overlapping ops merged:
    named ``thread T (name)`` or ``{action} stream S``."""
    pick = other | side
    if not pick.any():
        return df.iloc[:0]
    names = spans["name"].astype(str).to_numpy()
    src = np.where(
        side,
        [f"{names[o].removeprefix('PP:')} stream {s}" if o >= 0 else "" for o, s in
         zip(owner, ops["stream"], strict=True)],
        [thread_names.get(int(t)) or f"thread {int(t)}" for t in ops["tid"]],
    )[pick]  # fmt: skip
    steps = df[(df["kind"].astype(str) == "other") & (df["name"].astype(str) == "STEP")]
    st0, st1, stk = (steps[c].to_numpy() for c in ("launch_start_ns", "launch_end_ns", "step"))
    o0, o1 = ops["start_ns"].to_numpy()[pick], ops["end_ns"].to_numpy()[pick]
    ol = ops["launch_ns"].to_numpy()[pick]
    at = owners(st0, st1, ol) if len(steps) else np.full(len(ol), -1)
    rows = []
    table = pd.DataFrame({"src": src, "step": np.where(at >= 0, stk[np.maximum(at, 0)], -1),
                          "s": o0, "e": o1, "l": ol})[at >= 0]  # fmt: skip
    for (name, step), g in table.sort_values("s").groupby(["src", "step"], sort=False):
        cur = None
        for s_, e_, l_ in zip(g["s"], g["e"], g["l"], strict=True):
            if cur is not None and s_ <= cur[1]:
                cur[1] = max(cur[1], e_)
                cur[3] = max(cur[3], l_)
                continue
            if cur is not None:
                rows.append((name, step, *cur))
            cur = [s_, e_, l_, l_]
        rows.append((name, step, *cur))
    out = pd.DataFrame(rows, columns=["name", "step", "start_ns", "end_ns",
                                      "launch_start_ns", "launch_end_ns"])  # fmt: skip
    return out.assign(kind="GPU", stage=-1, microbatch=-1, clock="device",
                      busy_ns=out["end_ns"] - out["start_ns"], **{SPAN: -1})  # fmt: skip


def _data_end(
    waits: np.ndarray,
    spans: pd.DataFrame,
    has: np.ndarray,
    dev_end: np.ndarray,
    message_end: dict[int, int],
) -> np.ndarray:
    """Per WAIT span: the end of its received data on the device (-1 where unknown): its own
    ops (a copy into the device), else its message's NCCL kernel (``message_end`` of the
    latest span it waits for, ``WAIT:X`` -> ``X``, started before it), else that span's ops."""
    names = spans["name"].astype(str).to_numpy()
    starts = spans["start_ns"].to_numpy()
    by_name: dict[str, np.ndarray] = {}
    out = np.full(len(waits), -1, np.int64)
    for k, i in enumerate(waits):
        if has[i]:
            out[k] = dev_end[i]
            continue
        target = "PP:" + names[i].removeprefix("PP:WAIT:")
        if target not in by_name:
            found = np.flatnonzero(names == target)
            by_name[target] = found[np.argsort(starts[found], kind="stable")]
        cand = by_name[target]
        j = int(np.searchsorted(starts[cand], starts[i], side="right")) - 1 if len(cand) else -1
        if j >= 0 and int(cand[j]) in message_end:
            out[k] = message_end[int(cand[j])]
        elif j >= 0 and has[cand[j]]:
            out[k] = dev_end[cand[j]]
    return out
