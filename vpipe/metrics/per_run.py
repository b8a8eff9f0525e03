"""Metrics from event tables (measured or simulated alike) and memory tables.

Definitions (per run, step and rank; a step's figures are then combined over ranks):

- **window** (whole step): the rank's ``STEP`` span (``kind="other"``, ``name="STEP"``) when the
  table has one (measured runs), else the step's extent over all ranks, first event start to
  last event end (simulated runs, where every rank starts at the step's time 0).
- **step time**: the longest window over the ranks.
- **busy**: the union of the rank's compute spans (F, B, I, W) in the step, and on a CUDA trace
  its other GPU work (``GPU`` rows: another thread's launches, side-stream work, which kept the
  device busy though no action computed); communication and waiting are not busy.
  **idle** = window - busy.
- **bubble ratio** (whole step) = idle / (idle + busy) = 1 - busy / window.
- **bubble ratio excluding start-up skew** = 1 - busy / span, where span runs from the rank's
  first compute start to its last compute end, so the wait before a rank's first action and
  after its last one are not counted.
- A step's bubble ratios over ranks are 1 - sum(busy) / sum(window or span).
- **comm wait**: the union of the rank's ``WAIT`` spans (time blocked on communication).
- **regime figure** (per run): median compute span per action (F, B, I, W) / median cost of
  one message across a stage boundary, the median SEND span plus the median RECV span (the
  sender's and the receiver's post). Both vpipe's and torch's traces have these spans, so the
  figure means the same for both; blocking waits are left out, so it errs towards
  compute-bound. (torch's traces mark no waits: :mod:`vpipe.trace.operators` finds them.)

Spread over steps is given as the interquartile range (``*_q1``/``*_q3``) next to the median.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from vpipe.events import COMM_KINDS, COMPUTE_KINDS, DEVICE_BUSY_KINDS

KEYS = ["run_id", "step", "rank"]
# Kind of memory sample of ``vpipe bench``'s meter: bytes of tensors saved for backward.
SAVED_ACTIVATIONS = "saved_activations"
# Headline peak memory, first present wins: CUDA allocator peak, CUDA allocated, profiler's
# CPU allocation tracking, process RSS, saved activations.
PEAK_MEMORY_ORDER = ("cuda_peak", "cuda_allocated", "cpu_allocated", "rss", SAVED_ACTIVATIONS)


def _union_ns(df: pd.DataFrame, keys: list[str]) -> pd.Series:
    """Total length of the union of [start_ns, end_ns) intervals per group of ``keys``."""
    if df.empty:
        return pd.Series(dtype="int64", index=pd.MultiIndex.from_tuples([], names=keys))
    d = df.sort_values([*keys, "start_ns"])
    groups = [d[k] for k in keys]
    prev_end = d.groupby(groups, observed=True, sort=False)["end_ns"].cummax()
    prev_end = prev_end.groupby(groups, observed=True, sort=False).shift(1)
    start = d["start_ns"].to_numpy()
    eff_start = np.maximum(start, prev_end.fillna(-(2**62)).to_numpy(np.int64))
    contrib = np.maximum(0, d["end_ns"].to_numpy() - eff_start)
    return pd.Series(contrib, index=d.index).groupby(groups, observed=True).sum()


def rank_metrics(events: pd.DataFrame) -> pd.DataFrame:
    """One row per (run_id, step, rank): window, busy, idle, bubble ratios, comm wait (seconds)."""
    ev = events[events["step"] >= 0]
    if len(ev):  # relative times: exact in float64, which joins with missing values produce
        base = ev["start_ns"].min()
        ev = ev.assign(start_ns=ev["start_ns"] - base, end_ns=ev["end_ns"] - base)
    kind = ev["kind"].astype(str)
    compute = ev[kind.isin(COMPUTE_KINDS)]
    is_step = (kind == "other") & (ev["name"].astype(str) == "STEP")
    steps = (
        ev[is_step].groupby(KEYS, observed=True).agg(w0=("start_ns", "min"), w1=("end_ns", "max"))
    )
    whole = ev.groupby(["run_id", "step"], observed=True).agg(
        g0=("start_ns", "min"), g1=("end_ns", "max")
    )
    span = compute.groupby(KEYS, observed=True).agg(
        c0=("start_ns", "min"), c1=("end_ns", "max"), n_compute=("start_ns", "size")
    )
    out = span.join(steps, how="outer")
    out = out.join(whole, on=["run_id", "step"])
    window = (out["w1"] - out["w0"]).fillna(out["g1"] - out["g0"])
    busy = _union_ns(ev[kind.isin(DEVICE_BUSY_KINDS)], KEYS).reindex(out.index).fillna(0)
    wait = _union_ns(ev[kind == "WAIT"], KEYS).reindex(out.index).fillna(0)
    span_ns = (out["c1"] - out["c0"]).fillna(0)
    res = pd.DataFrame(
        {
            "window_s": window / 1e9,
            "busy_s": busy / 1e9,
            "idle_s": (window - busy) / 1e9,
            "bubble_ratio": 1 - busy / window,
            "span_s": span_ns / 1e9,
            "bubble_ratio_excl_skew": (1 - busy / span_ns.where(span_ns > 0)),
            "comm_wait_s": wait / 1e9,
            "n_compute": out["n_compute"].fillna(0).astype(int),
        },
        index=out.index,
    )
    return res.reset_index()


def step_metrics(events: pd.DataFrame) -> pd.DataFrame:
    """One row per (run_id, step): step time, busy, bubble ratios over ranks, comm wait (max
    over ranks), in seconds."""
    return combine_ranks(rank_metrics(events))


def combine_ranks(r: pd.DataFrame) -> pd.DataFrame:
    """:func:`step_metrics` from the per-rank rows of :func:`rank_metrics`."""
    if r.empty:
        cols = ["run_id", "step", "step_time_s", "busy_s", "bubble_ratio", "bubble_ratio_excl_skew",
                "comm_wait_s", "ranks"]  # fmt: skip
        return pd.DataFrame({c: [] for c in cols})
    g = r.groupby(["run_id", "step"], observed=True)
    out = pd.DataFrame(
        {
            "step_time_s": g["window_s"].max(),
            "busy_s": g["busy_s"].sum(),
            "bubble_ratio": 1 - g["busy_s"].sum() / g["window_s"].sum(),
            "bubble_ratio_excl_skew": 1 - g["busy_s"].sum() / g["span_s"].sum(),
            "comm_wait_s": g["comm_wait_s"].max(),
            "ranks": g["rank"].nunique(),
        }
    )
    return out.reset_index()


def regime_figure(events: pd.DataFrame) -> float | None:
    """Median compute span per action over the median send plus the median receive span, in
    the profiled steps; None without compute or without both kinds of message span."""
    ev = events[events["step"] >= 0]
    kind = ev["kind"].astype(str)
    dur = ev["end_ns"] - ev["start_ns"]
    compute = dur[kind.isin(COMPUTE_KINDS)]
    sends = dur[kind.isin([k for k in COMM_KINDS if k.startswith("SEND")])]
    recvs = dur[kind.isin([k for k in COMM_KINDS if k.startswith("RECV")])]
    if compute.empty or sends.empty or recvs.empty:
        return None
    comm = sends.median() + recvs.median()
    return float(compute.median() / comm) if comm > 0 else float("inf")


def peak_memory(memory: pd.DataFrame) -> pd.DataFrame:
    """Peak bytes per (run_id, rank) and kind of sample (columns: cpu_allocated, rss, ...)."""
    if memory is None or memory.empty:
        return pd.DataFrame()
    m = memory.assign(what=memory["what"].astype(str))
    return m.pivot_table(
        index=["run_id", "rank"], columns="what", values="bytes", aggfunc="max", observed=True
    )


def headline_peak_bytes(memory: pd.DataFrame | None) -> int | None:
    """The run's peak memory in bytes (max over ranks) by :data:`PEAK_MEMORY_ORDER`, or None."""
    return headline_peak(peak_memory(memory) if memory is not None else pd.DataFrame())


def headline_peak(peaks: pd.DataFrame) -> int | None:
    """:func:`headline_peak_bytes` from per-rank peaks by kind (:func:`peak_memory`'s table)."""
    for what in PEAK_MEMORY_ORDER:
        if what in peaks.columns and peaks[what].notna().any():
            return int(peaks[what].max())
    return None


def quartiles(values: Sequence[float] | pd.Series) -> tuple[float, float, float]:
    """(q1, median, q3) of the non-missing values; all NaN when there are none."""
    s = pd.Series(values, dtype="float64")
    q = s.dropna().quantile([0.25, 0.5, 0.75]) if s.notna().any() else None
    return (float("nan"),) * 3 if q is None else (float(q[0.25]), float(q[0.5]), float(q[0.75]))


def kind_durations(events: pd.DataFrame) -> pd.DataFrame:
    """Median, q1, q3 and count of span durations (seconds) per (stage, kind)."""
    ev = events[events["kind"].astype(str).isin([*COMPUTE_KINDS, *COMM_KINDS, "WAIT"])]
    d = ev.assign(dur_s=(ev["end_ns"] - ev["start_ns"]) / 1e9, kind=ev["kind"].astype(str))
    g = d.groupby(["stage", "kind"])["dur_s"]
    return pd.DataFrame(
        {"median_s": g.median(), "q1_s": g.quantile(0.25), "q3_s": g.quantile(0.75), "n": g.size()}
    ).reset_index()


def compare(
    measured: Mapping[str, Any], simulated: Mapping[str, Any], keys: list[str]
) -> pd.DataFrame:
    """Side-by-side table of metrics with the relative error (simulated / measured - 1)."""
    rows = []
    for k in keys:
        m, s = measured.get(k), simulated.get(k)
        err = (
            (s / m - 1) if m not in (None, 0) and s is not None and not pd.isna(m) else float("nan")
        )
        rows.append({"metric": k, "measured": m, "simulated": s, "error": err})
    return pd.DataFrame(rows)


def pareto_front(df: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """The rows of ``df`` that no other row beats: none has ``x`` lower-or-equal and ``y``
    higher-or-equal with one of them strict (e.g. x peak memory, y throughput: the configs
    worth choosing for some memory budget).

    Rows tied on both columns are all on the front (neither beats the other); rows missing
    ``x`` or ``y`` are left out. Returned with their index, sorted by ``x`` ascending."""
    d = df.dropna(subset=[x, y])
    xs = d[x].to_numpy(dtype=float)[:, None]
    ys = d[y].to_numpy(dtype=float)[:, None]
    # beats[i, j]: row j is at least as good as row i on both columns and better on one
    beats = (xs.T <= xs) & (ys.T >= ys) & ((xs.T < xs) | (ys.T > ys))
    return d[~beats.any(axis=1)].sort_values([x, y], ascending=[True, False], kind="stable")


def step_breakdown(events: pd.DataFrame) -> pd.DataFrame:
    """Where each rank's step goes, per (run_id, step, rank), in seconds: ``compute`` (F, B, I,
    W spans), ``wait`` (WAIT spans: blocked on a receive), ``post`` (SEND/RECV spans: posting
    communication) and ``other`` (the rest of the step window: the runtime's own work between
    actions, and for torch its unlabelled waits). Overlapping spans count once, in that order
    of precedence, so the four add up to the window."""
    r = rank_metrics(events).set_index(KEYS)
    ev = events[events["step"] >= 0]
    kind = ev["kind"].astype(str)
    groups = {
        "compute": kind.isin(COMPUTE_KINDS),
        "wait": kind == "WAIT",
        "post": kind.isin(COMM_KINDS),
    }
    out = pd.DataFrame(index=r.index)
    covered = pd.Series(0.0, index=r.index)
    mask = pd.Series(False, index=ev.index)
    for name, sel in groups.items():
        mask = mask | sel
        union = _union_ns(ev[mask], KEYS).reindex(r.index).fillna(0) / 1e9
        out[name] = union - covered
        covered = union
    out["other"] = (r["window_s"] - covered).clip(lower=0)
    out["window"] = r["window_s"]
    return out.reset_index()
