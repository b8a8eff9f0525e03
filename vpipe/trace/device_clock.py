"""Put a CUDA trace's actions on the device's clock.

On a GPU the host only enqueues work: a ``PP:{action}`` span on the CPU is the time to launch
the action's kernels, and the host runs ahead of the device until the step's synchronise. What
the device did is in Kineto's ``gpu_user_annotation`` copy of the span (same name, on a GPU
stream: from the first kernel launched inside the range to the end of the last). This module
matches those device spans to their CPU spans and rewrites the rows of one rank:

- a compute row (F, B, I, W) takes its device interval (``clock="device"``); its CPU span is
  kept as ``launch_start_ns``/``launch_end_ns``. One row per action stays one row.
- a ``WAIT`` row becomes the time the device waited for that receive: from the later of the
  device's previous compute end and the host asking for the data (the WAIT span's start) to
  the consuming action's device start, zero when the device was not idle then. On NCCL
  ``Work.wait()`` returns at once (the stream waits, not the host), so this gap is the only
  place the wait shows.
- every other row (the step span, SEND/RECV posts) stays on the host clock: the step span ends
  after the step's device synchronise, so it covers the device work, and posting is host work.

Matching rule: a device span belongs to the latest CPU span of the same name that started at
or before it (work cannot run before it is launched; the runtime synchronises at each step's
end, so an action's device span never reaches the next launch of the same name). Several
device spans of one CPU span (work on several streams) give their extent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from vpipe.events import COMPUTE_KINDS

DEV_START, DEV_END = "dev_start_ns", "dev_end_ns"


def device_intervals(
    names: Sequence[str], starts_ns: np.ndarray, device: Mapping[str, list], base_ns: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per CPU span (``names``, ``starts_ns``), the device interval of its GPU-stream copies
    (``device``: name, ts, dur in microseconds after ``base_ns``); -1 where it has none."""
    n = len(names)
    out_s, out_e = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    if not device["name"] or not n:
        return out_s, out_e
    ts = np.asarray(device["ts"], np.float64)
    d_start = base_ns + np.rint(ts * 1000.0).astype(np.int64)
    d_end = base_ns + np.rint((ts + np.asarray(device["dur"], np.float64)) * 1000.0).astype(
        np.int64
    )
    cpu = pd.DataFrame(
        {"name": list(names), "t": np.asarray(starts_ns, np.int64), "i": np.arange(n)}
    )
    dev = pd.DataFrame({"name": list(device["name"]), "t": d_start, "e": d_end})
    matched = pd.merge_asof(
        dev.sort_values("t"), cpu.sort_values("t"), on="t", by="name", direction="backward"
    ).dropna(subset=["i"])
    if matched.empty:
        return out_s, out_e
    g = matched.groupby("i").agg(s=("t", "min"), e=("e", "max"))
    idx = g.index.to_numpy(np.int64)
    out_s[idx], out_e[idx] = g["s"].to_numpy(), g["e"].to_numpy()
    return out_s, out_e


def has_device_intervals(df: pd.DataFrame) -> bool:
    """Whether any compute row of ``df`` (with the device columns) has a device interval."""
    return bool((df[DEV_START].to_numpy()[df["kind"].isin(COMPUTE_KINDS).to_numpy()] >= 0).any())


def to_device_clock(df: pd.DataFrame) -> pd.DataFrame:
    """One rank's rows (raw CPU intervals and the device columns) on the device clock, as the
    module docstring says; the device columns are dropped."""
    df = df.copy()
    df["launch_start_ns"], df["launch_end_ns"] = df["start_ns"], df["end_ns"]
    on_dev = df["kind"].isin(COMPUTE_KINDS).to_numpy() & (df[DEV_START].to_numpy() >= 0)
    df.loc[on_dev, "start_ns"] = df.loc[on_dev, DEV_START]
    df.loc[on_dev, "end_ns"] = df.loc[on_dev, DEV_END]
    clock = np.where(on_dev, "device", "host").astype(object)
    waits = np.flatnonzero(df["kind"].to_numpy() == "WAIT")
    if len(waits) and on_dev.any():
        at, starts, ends = _device_waits(df, on_dev, waits)
        df.iloc[at, df.columns.get_loc("start_ns")] = starts
        df.iloc[at, df.columns.get_loc("end_ns")] = ends
        clock[at] = "device"
    df["clock"] = clock
    return df.drop(columns=[DEV_START, DEV_END])


def _device_waits(
    df: pd.DataFrame, on_dev: np.ndarray, waits: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row positions, device start, device end) of the WAIT rows whose consumer ran on the
    device: the consumer is the device compute row whose launch span holds the wait."""
    ls, le = df["launch_start_ns"].to_numpy(), df["launch_end_ns"].to_numpy()
    ds, de = df["start_ns"].to_numpy(), df["end_ns"].to_numpy()
    dev = np.flatnonzero(on_dev)
    by_launch = dev[np.argsort(ls[dev], kind="stable")]
    by_start = dev[np.argsort(ds[dev], kind="stable")]
    sorted_starts = ds[by_start]
    end_so_far = np.maximum.accumulate(de[by_start])
    at, starts, ends = [], [], []
    for w in waits:
        k = np.searchsorted(ls[by_launch], ls[w], side="right") - 1
        if k < 0 or le[by_launch[k]] < le[w]:
            continue  # not inside a device action's launch span: left on the host clock
        consumer_start = ds[by_launch[k]]
        j = np.searchsorted(sorted_starts, consumer_start, side="left") - 1
        prev_end = end_so_far[j] if j >= 0 else ls[w]
        start = min(max(prev_end, ls[w]), consumer_start)
        at.append(w)
        starts.append(start)
        ends.append(consumer_start)
    return np.asarray(at, np.int64), np.asarray(starts, np.int64), np.asarray(ends, np.int64)
