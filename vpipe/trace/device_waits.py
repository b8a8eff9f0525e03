"""WAIT rows on the device clock for CUDA traces whose runtime does not mark its waits
(torch.distributed.pipelining on NCCL).

torch's runtime posts a receive in a RECV action (``PP:1RECV_F3``: ``irecv`` launches the NCCL
receive kernel on NCCL's stream) and waits for it at the start of the consuming F/I/B, inside
that action's span; its single-stage GPipe posts and waits inside the consuming ``Forward i`` /
``Backward i`` span itself, before launching the compute. On NCCL that wait blocks the compute
stream, not the host: the host goes on launching, the action's first kernel starts when the
receive kernel ends, and nothing on the host marks the wait. So a compute action A (F, I or B)
that received its input gets a WAIT row, by the rule of vpipe's own device WAIT rows
(:mod:`vpipe.trace.device_clock`), so that both runtimes' waits mean the same:

- it starts at the later of the device's previous work end (the ops launched before A's span
  began) and A's span start (where the host asked for the data);
- it ends at the end of the NCCL kernel A's data came in: the kernels of the latest
  ``{stage}RECV_F{mb}`` span (``RECV_B`` for an I or B) started before A's, else the NCCL
  kernels A's own span launched before its first compute op (GPipe's); never past A's first
  compute op. What follows the data until A's first kernel is launch lag, not waiting.
- it is empty where the data was there first; named ``WAIT(ops):{the receive}`` as the waits
  found on the CPU (:mod:`vpipe.trace.operators`). A W (it receives nothing) and an action
  whose data came in no kernel of the trace (the first stage's F) get none.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from vpipe.trace.operators import wait_name

_RECV = {"F": "RECV_F", "I": "RECV_B", "B": "RECV_B"}


def data_ends(ops: pd.DataFrame, owner: np.ndarray) -> tuple[dict[int, int], dict[int, int]]:
    """Per span (its index): the end of the NCCL kernels it launched, and for a span that
    also launched compute, of those it launched before its first compute op."""
    nccl = ops["nccl"].to_numpy()
    launch, end = ops["launch_ns"].to_numpy(), ops["end_ns"].to_numpy()
    first: dict[int, int] = {}
    for o, t in zip(owner[~nccl & (owner >= 0)], launch[~nccl & (owner >= 0)], strict=True):
        first[int(o)] = min(first.get(int(o), t), int(t))
    every: dict[int, int] = {}
    before: dict[int, int] = {}
    for o, t, e in zip(owner[nccl & (owner >= 0)], launch[nccl & (owner >= 0)],
                       end[nccl & (owner >= 0)], strict=True):  # fmt: skip
        o = int(o)
        every[o] = max(every.get(o, -1), int(e))
        if o in first and t < first[o]:
            before[o] = max(before.get(o, -1), int(e))
    return every, before


def found_device_waits(
    rows: pd.DataFrame,
    span_col: str,
    spans: pd.DataFrame,
    ops: pd.DataFrame,
    owner: np.ndarray,
    reach_before: Callable[[np.ndarray], np.ndarray],
) -> pd.DataFrame:
    """WAIT rows (module docstring) for ``rows``, compute rows already on the device clock
    (``span_col`` their span's index in ``spans``); ``owner`` is each op's span (-1: none),
    ``reach_before(t)`` the device's latest end of the ops launched before host time ``t``.
    The rows keep the consumer's columns (``span_col`` included)."""
    rows = rows[rows["kind"].astype(str).isin(tuple(_RECV)) & (rows["clock"] == "device")]
    if rows.empty:
        return rows
    every, before = data_ends(ops, owner)
    names = spans["name"].astype(str).to_numpy()
    s0 = spans["start_ns"].to_numpy()
    recv_spans: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # name -> (starts, indices)
    for name in {n for n in names if "RECV_" in n}:
        at = np.flatnonzero(names == name)
        at = at[np.argsort(s0[at], kind="stable")]
        recv_spans[name] = (s0[at], at)
    data_end = np.full(len(rows), -1, np.int64)
    idx = rows[span_col].to_numpy()
    for k, (kind, stage, mb, i) in enumerate(
        zip(rows["kind"].astype(str), rows["stage"], rows["microbatch"], idx, strict=True)
    ):
        found = recv_spans.get(f"PP:{stage}{_RECV[kind]}{mb}")
        if found is not None:
            j = int(np.searchsorted(found[0], s0[i], side="right")) - 1
            if j >= 0 and int(found[1][j]) in every:
                data_end[k] = every[int(found[1][j])]
                continue
        data_end[k] = before.get(int(i), -1)
    ok = data_end >= 0
    rows, data_end, idx = rows[ok], data_end[ok], idx[ok]
    consumer = rows["start_ns"].to_numpy()
    begin = np.minimum(np.maximum(reach_before(s0[idx]), s0[idx]), consumer)
    stop = np.maximum(np.minimum(data_end, consumer), begin)
    what = rows[["kind", "stage", "microbatch", "name"]].itertuples(index=False)
    out = rows.assign(
        kind="WAIT",
        name=[wait_name(*w) for w in what],
        start_ns=begin,
        end_ns=stop,
        busy_ns=stop - begin,
    )
    # an overlap action's parts that waited alike: one row
    return out.drop_duplicates(["start_ns", "end_ns", span_col])
