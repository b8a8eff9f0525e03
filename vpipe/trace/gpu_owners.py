"""Who a CUDA trace's GPU ops belong to: the threads that launch for actions, the stream that
computes, and the NCCL kernel that lands each received message.

- **Threads.** An action owns the launches of the threads that work for it: the thread holding
  the ``PP:`` spans, and autograd's worker threads, which launch every backward kernel while
  the main thread waits inside the action's span. A thread is taken as autograd's by its name
  where the trace names it so (``autograd`` in it); a thread with no name of its own (none, or
  the process's, as Kineto writes an unnamed Python thread) is one when every launch it made
  lies inside a compute span; any other thread (a data loader's, a compiler's workers') does
  other GPU work, never an action's.
- **Streams.** An action may launch on several streams: its compute row is the work of the
  rank's compute stream (the stream carrying most of the compute actions' GPU time); what it
  put on another stream is side-stream work, shown apart.
- **Messages.** The runtime posts a run of adjacent communication actions as one batch, inside
  the last one's span; on NCCL the batch is one grouped kernel carrying every message of the
  batch (sends and receives), or one kernel per message. A received message's data is on the
  device when its batch's kernel ends: the grouped kernel (which ends all of its messages), the
  message's own kernel where the batch launched one per message (matched in posting order),
  else the batch's last.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

_OWN_NAME = re.compile(r"\((.*)\)\s*$")  # Kineto: "thread 650 (python3)"


def _own_name(name: str) -> str:
    """A thread's own name from Kineto's ``thread N (name)``; '' for an unnamed thread (no
    name, or the Python process's, which an unnamed thread carries)."""
    m = _OWN_NAME.search(name)
    own = (m.group(1) if m else name).strip()
    return "" if not own or own.lower().startswith("python") else own


def action_threads(
    launch_tid: np.ndarray,
    launch_ns: np.ndarray,
    span_tids: set[int],
    compute: tuple[np.ndarray, np.ndarray],
    thread_names: dict[int, str],
) -> set[int]:
    """The threads whose launches belong to the action open at their launch (see the module
    docstring): the spans' threads, autograd's by name, and unnamed threads that launched
    only inside compute spans (``compute``: their starts and ends)."""
    out = set(span_tids)
    c0, c1 = merged_intervals(*compute)
    for tid in np.unique(launch_tid):
        tid = int(tid)
        if tid in out:
            continue
        own = _own_name(thread_names.get(tid, ""))
        if "autograd" in own.lower():
            out.add(tid)
        elif not own:
            t = launch_ns[launch_tid == tid]
            i = np.searchsorted(c0, t, side="right") - 1
            if len(c0) and (i >= 0).all() and (t <= c1[np.maximum(i, 0)]).all():
                out.add(tid)
    return out


def merged_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [start, end) as sorted disjoint intervals (touching ones joined)."""
    order = np.argsort(starts, kind="stable")
    s = np.asarray(starts, np.int64)[order]
    reach = np.maximum.accumulate(np.asarray(ends, np.int64)[order])
    if not len(s):
        return s, reach
    new = np.concatenate(([True], s[1:] > reach[:-1]))
    first = np.flatnonzero(new)
    return s[first], reach[np.concatenate((first[1:] - 1, [len(s) - 1]))]


def union_length(starts: np.ndarray, ends: np.ndarray) -> int:
    """Length of the union of intervals [start, end)."""
    a, b = merged_intervals(starts, ends)
    return int((b - a).sum())


def compute_stream(ops: pd.DataFrame, in_compute: np.ndarray) -> int | None:
    """The stream carrying most of the compute actions' GPU time (None without any)."""
    mine = ops[in_compute & ~ops["nccl"].to_numpy()]
    if mine.empty:
        return None
    return int((mine["end_ns"] - mine["start_ns"]).groupby(mine["stream"]).sum().idxmax())


def message_ends(
    batch_of: dict[int, int], is_recv: dict[int, bool], owner: np.ndarray, ops: pd.DataFrame
) -> dict[int, int]:
    """Per RECV span (its index): the device end of its message's NCCL kernel (see the module
    docstring). ``batch_of`` maps each communication span to its batch (spans of one batch
    in posting order), ``owner`` each op's span (-1: none)."""
    nccl = ops["nccl"].to_numpy() & (owner >= 0)
    kernels: dict[int, list[tuple[int, int]]] = {}
    for i in np.flatnonzero(nccl):
        b = batch_of.get(int(owner[i]))
        if b is not None:
            kernels.setdefault(b, []).append(
                (int(ops["launch_ns"].iat[i]), int(ops["end_ns"].iat[i]))
            )
    members: dict[int, list[int]] = {}
    for span, b in batch_of.items():
        members.setdefault(b, []).append(span)
    out = {}
    for b, spans in members.items():
        found = sorted(kernels.get(b, []))
        if not found:
            continue
        last = max(end for _, end in found)
        one_each = len(found) == len(spans) > 1
        for k, span in enumerate(spans):  # in posting order, as batch_of lists them
            if is_recv[span]:
                out[span] = found[k][1] if one_each else last
    return out
