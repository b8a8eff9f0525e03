"""The one event schema shared by simulated and measured runs.

Every producer (simulator, profiler-trace converter) emits a DataFrame with exactly
``EVENT_COLUMNS`` (see :func:`events_frame`), so analysis, plots and reports work on both, and
"how well does the simulator predict the machine" is one join on (rank, step, stage,
microbatch, kind).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

# 2: dictionary columns always have int32 indices (readable as one dataset by pandas and
# pyarrow.dataset); version-1 files read through vpipe's Store, and `vpipe runs --upgrade`
# rewrites them. 3: the clock columns (``clock``, ``launch_start_ns``, ``launch_end_ns``);
# reading an older file fills them in (:func:`with_clock_columns`), ``--upgrade`` writes them.
# 4: ``busy_ns`` (filled in likewise for older files).
SCHEMA_VERSION = 4

# Column -> pandas dtype. Strings are categoricals (dictionary-encoded in Parquet).
# stage and microbatch are -1 where they do not apply (WAIT spans, "other").
EVENT_COLUMNS: dict[str, str] = {
    "run_id": "category",
    "source": "category",  # measured | simulated
    "impl": "category",  # vpipe | torch | sim
    "schedule": "category",
    "rank": "int32",
    "step": "int32",
    "stage": "int32",
    "microbatch": "int32",
    "kind": "category",  # F B I W SEND_F RECV_F SEND_B RECV_B WAIT REDUCE GPU other
    "name": "category",  # the action string (e.g. 2F3) or span name
    "start_ns": "int64",
    "end_ns": "int64",
    # Which clock start_ns/end_ns are on: "host" (the CPU span), "device" (the GPU's: a CUDA
    # trace's device span of the action, or CUDA events on its stream) or "sim".
    "clock": "category",
    # The host span that launched the row (equal to start/end on the host clock); on CUDA the
    # host runs ahead of the device, so this is when the work was enqueued, not when it ran.
    "launch_start_ns": "int64",
    "launch_end_ns": "int64",
    # Time the row's work occupied its clock: on the device, the union of the GPU ops the action
    # launched (0: an action that launched none, an empty row marked so); else end - start.
    "busy_ns": "int64",
}
CLOCKS = ("host", "device", "sim")

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
# REDUCE: data parallel. GPU: other GPU work on a CUDA trace (another thread's launches, an
# action's side-stream work): the device was busy, but with no action's computing
EVENT_KINDS = (*COMPUTE_KINDS, *COMM_KINDS, "WAIT", "REDUCE", "GPU", "other")
DEVICE_BUSY_KINDS = (*COMPUTE_KINDS, "GPU")  # what counts as the rank's device being busy
# An "other" row's name: a call inside a forward that selective recomputation would rerun
# (vpipe.runtime.recompute marks it while profiling; vpipe.predict.recompute_share reads it)
RECOMPUTABLE = "RECOMPUTABLE"

MEMORY_COLUMNS: dict[str, str] = {
    "run_id": "category",
    "source": "category",
    "rank": "int32",
    "step": "int32",
    "t_ns": "int64",
    "bytes": "int64",
    "what": "category",  # allocated | reserved | rss | activations
}


def _frame(
    columns: Mapping[str, str], data: Mapping[str, Any] | Iterable[Mapping[str, Any]]
) -> pd.DataFrame:
    df = pd.DataFrame(data)
    if df.empty:
        df = pd.DataFrame({c: pd.Series(dtype=t) for c, t in columns.items()})
        return df
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"event data lacks columns {missing}")
    return df[list(columns)].astype(dict(columns))


def with_clock_columns(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with the clock columns filled in where it lacks them (tables of schema version 2
    and 3, and producers that have one clock): ``clock`` "sim" for simulated rows, else "host",
    the launch span equal to the row's own and ``busy_ns`` its length."""
    add: dict[str, Any] = {}
    if "clock" not in df.columns:
        simulated = df["source"].astype(str) == "simulated" if "source" in df.columns else False
        add["clock"] = pd.Series(simulated, index=df.index).map({True: "sim", False: "host"})
    if "launch_start_ns" not in df.columns and "start_ns" in df.columns:
        add["launch_start_ns"] = df["start_ns"]
    if "launch_end_ns" not in df.columns and "end_ns" in df.columns:
        add["launch_end_ns"] = df["end_ns"]
    if "busy_ns" not in df.columns and {"start_ns", "end_ns"} <= set(df.columns):
        add["busy_ns"] = df["end_ns"] - df["start_ns"]
    return df.assign(**add) if add else df


def events_frame(data: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Coerce column data (dict of lists) or records to the event schema, columns in order
    (the clock columns default as :func:`with_clock_columns` says)."""
    df = pd.DataFrame(data)
    return _frame(EVENT_COLUMNS, with_clock_columns(df) if len(df) else df)


def memory_frame(data: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Coerce memory samples to the memory schema."""
    return _frame(MEMORY_COLUMNS, data)
