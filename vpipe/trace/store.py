"""The results store: a runs table plus event and memory datasets, in Parquet, append-only.

Layout under a root directory (``results/`` by default)::

    ROOT/
      runs/run_id=<RUN>.parquet                    one file per run: its row(s) of the runs table
      events/run_id=<RUN>/rank=<R>/part-0.parquet  the run's event table (vpipe.events schema)
      memory/run_id=<RUN>/rank=<R>/part-0.parquet  the run's memory samples

- **Runs table** (``Store.runs()``, or ``pandas.read_parquet("ROOT/runs")``): one row per run
  (one launch of one config). Standard columns (:func:`run_columns`): metadata ``run_id``,
  ``created``, ``commit``, ``host``, ``torch``, ``device``, ``backend``, ``ranks``, ``stages``,
  ``microbatches``, ``model``, ``batch``, ``impl``, ``schedule``, ``source``; one column per
  metric of the registry (:mod:`vpipe.metrics.catalogue`: ``step_time_s`` median over steps,
  ``step_time_q1_s`` / ``step_time_q3_s`` interquartile range, ``samples_per_s``,
  ``bubble_ratio``, ``peak_memory_bytes``, ...); ``status``. Extra columns are kept.
- **Events and memory** are Hive-partitioned by run and rank, so
  ``pandas.read_parquet("ROOT/events")`` reads them all and ``Store.events(run_ids=[...])``
  reads only the runs asked for. Strings are dictionary-encoded, files zstd-compressed.
- **Schema version**: every file carries ``{"schema_version": N, ...}`` under the Parquet
  key-value metadata key ``vpipe``; reading a file written by a newer version is a TraceError.
- **Atomic, append-only**: every file is written to a hidden temp file in its own directory and
  renamed into place (``os.replace``). A run's events and memory are written first and its runs
  file last, as the commit point: readers only see runs whose runs file exists, so a run killed
  mid-write leaves earlier results intact and nothing half-written visible. Appending a run
  never touches another run's files; appending a run id that is already committed is an error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from vpipe.errors import TraceError
from vpipe.events import (
    EVENT_COLUMNS,
    MEMORY_COLUMNS,
    SCHEMA_VERSION,
    events_frame,
    memory_frame,
    with_clock_columns,
)
from vpipe.metrics.catalogue import registry

META_KEY = b"vpipe"

META_COLUMNS: dict[str, str] = {
    "run_id": "string",
    "created": "string",  # ISO 8601 UTC
    "commit": "string",
    "host": "string",
    "torch": "string",
    "device": "string",
    "backend": "string",
    "ranks": "Int64",
    "stages": "Int64",
    "microbatches": "Int64",
    "model": "string",
    "batch": "Int64",
    "impl": "string",
    "schedule": "string",
    "source": "string",
}


def run_columns() -> dict[str, str]:
    """The standard columns and their dtypes: metadata, every registered metric, status."""
    return {
        **META_COLUMNS,
        **{m.name: m.dtype for m in registry()},
        "status": "string",
    }


RUN_COLUMNS = run_columns()  # those of the built-in metrics


_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is safe as a directory name, else raise TraceError."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise TraceError(
            f"invalid run id {run_id!r}: use letters, digits, '.', '_', '+', '-' "
            "(up to 200 characters, starting with a letter or digit)"
        )
    return run_id


def write_parquet(df: pd.DataFrame, path: str | os.PathLike[str], meta: Mapping[str, Any]) -> None:
    """Write ``df`` atomically to ``path`` (zstd, dictionary-encoded strings) with ``meta`` and
    the schema version in the file's key-value metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = fixed_schema(pa.Table.from_pandas(df, preserve_index=False))
    kv = dict(table.schema.metadata or {})
    kv[META_KEY] = json.dumps({**meta, "schema_version": SCHEMA_VERSION}, default=str).encode()
    table = table.replace_schema_metadata(kv)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd", use_dictionary=True)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def fixed_schema(table: pa.Table) -> pa.Table:
    """The table with one index width for every dictionary column (int32 indices).

    pandas stores a categorical's codes in the narrowest integer that fits (int8 up to 127
    categories, then int16), so files of one dataset would disagree on the type and
    ``pyarrow.dataset`` / ``pandas.read_parquet(ROOT/events)`` refuse to combine them.
    """
    fields = []
    for f in table.schema:
        if pa.types.is_dictionary(f.type):
            f = f.with_type(pa.dictionary(pa.int32(), f.type.value_type))
        fields.append(f)
    return table.cast(pa.schema(fields, metadata=table.schema.metadata))


def read_parquet(path: str | os.PathLike[str]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Read one vpipe Parquet file; return (frame, vpipe metadata). Checks the schema version."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise TraceError(f"{path}: unreadable Parquet file: {e}") from None
    meta = parquet_meta(table.schema, path)
    return table.to_pandas(), meta


def parquet_meta(schema: pa.Schema, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The vpipe metadata of a Parquet schema, checked against this version."""
    raw = (schema.metadata or {}).get(META_KEY)
    meta = json.loads(raw) if raw else {}
    version = meta.get("schema_version", SCHEMA_VERSION)
    if version > SCHEMA_VERSION:
        raise TraceError(
            f"{path}: written with vpipe schema version {version}, this vpipe reads up to "
            f"{SCHEMA_VERSION}; upgrade vpipe to read it"
        )
    return meta


def runs_frame(
    rows: pd.DataFrame | Mapping[str, Any] | Iterable[Mapping[str, Any]],
) -> pd.DataFrame:
    """Rows of the runs table with the standard columns first (missing ones are NA)."""
    if isinstance(rows, Mapping):
        rows = [dict(rows)]
    df = pd.DataFrame(rows).copy()
    columns = run_columns()
    for col, dtype in columns.items():
        df[col] = (
            df[col].astype(dtype)
            if col in df.columns
            else pd.Series(pd.NA, index=df.index, dtype=dtype)
        )
    extra = [c for c in df.columns if c not in columns]
    for col in extra:  # text (JSON) where a run has it: text in every run's file, never NaN
        values = df[col].dropna()
        if df[col].dtype == object and len(values) and values.map(type).eq(str).all():
            df[col] = df[col].astype("string")
    return df[list(columns) + extra]


def meta_columns(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Run metadata as runs-table columns: scalars as they are, nested values as JSON text."""
    out: dict[str, Any] = {}
    for k, v in meta.items():
        if isinstance(v, (dict, list, tuple)):
            out[k] = json.dumps(v, default=str)
        elif v is None or isinstance(v, (str, int, float, bool)):
            out[k] = v
    return out


@dataclass
class StoredRun:
    """One committed run: its row of the runs table (as :meth:`Store.run_meta` gives it), its
    event table and its memory samples."""

    meta: dict[str, Any]
    events: pd.DataFrame
    memory: pd.DataFrame


class Store:
    """A results directory; see the module docstring for the layout and guarantees."""

    def __init__(self, root: str | os.PathLike[str] = "results") -> None:
        self.root = Path(root)

    # -- writing -----------------------------------------------------------------------------
    def append_run(
        self,
        run: pd.DataFrame | Mapping[str, Any],
        events: pd.DataFrame | None = None,
        memory: pd.DataFrame | None = None,
    ) -> str:
        """Add one run: its runs-table row(s), event table and memory samples. Returns its id."""
        rows = runs_frame(run)
        ids = set(rows["run_id"].dropna())
        if len(ids) != 1 or rows["run_id"].isna().any():
            raise TraceError(f"a run's rows need exactly one run_id, got {sorted(ids) or 'none'}")
        run_id = check_run_id(ids.pop())
        if self._run_file(run_id).exists():
            raise TraceError(f"{self.root}: run {run_id!r} is already in the store")
        for table, frame, coerce in (
            ("events", events, events_frame),
            ("memory", memory, memory_frame),
        ):
            shutil.rmtree(self.root / table / f"run_id={run_id}", ignore_errors=True)  # orphans
            if frame is not None and len(frame):
                self._write_partitions(table, run_id, coerce(frame))
        write_parquet(rows, self._run_file(run_id), {"table": "runs", "run_id": run_id})
        return run_id

    def _write_partitions(self, table: str, run_id: str, df: pd.DataFrame) -> None:
        found = set(df["run_id"].astype(str).unique())
        if found != {run_id}:
            raise TraceError(f"{table} rows belong to runs {sorted(found)}, expected {run_id!r}")
        part = df.drop(columns=["run_id"])
        for rank, group in part.groupby("rank", observed=True, sort=True):
            path = self.root / table / f"run_id={run_id}" / f"rank={int(rank)}" / "part-0.parquet"
            write_parquet(
                group.drop(columns=["rank"]).reset_index(drop=True),
                path,
                {"table": table, "run_id": run_id, "rank": int(rank)},
            )

    def _run_file(self, run_id: str) -> Path:
        return self.root / "runs" / f"run_id={run_id}.parquet"

    def upgrade(self) -> int:
        """Rewrite every file written by an older vpipe in the current schema (atomically, one
        file at a time, runs files last); returns how many were rewritten."""
        done = 0
        for table in ("events", "memory", "runs"):
            for path in sorted((self.root / table).rglob("*.parquet")):
                if path.name.startswith("."):
                    continue
                df, meta = read_parquet(path)
                if meta.get("schema_version", SCHEMA_VERSION) < SCHEMA_VERSION:
                    if table == "events":
                        df = with_clock_columns(df)
                    write_parquet(
                        df, path, {k: v for k, v in meta.items() if k != "schema_version"}
                    )
                    done += 1
        return done

    # -- reading -----------------------------------------------------------------------------
    def run_ids(self) -> list[str]:
        """Committed runs, sorted."""
        runs_dir = self.root / "runs"
        if not runs_dir.is_dir():
            return []
        return sorted(
            p.name[len("run_id=") : -len(".parquet")]
            for p in runs_dir.glob("run_id=*.parquet")
            if not p.name.startswith(".")
        )

    def runs(self) -> pd.DataFrame:
        """The runs table, one row per committed run (empty with the standard columns if none)."""
        frames = [read_parquet(self._run_file(r))[0] for r in self.run_ids()]
        return runs_frame(pd.concat(frames, ignore_index=True) if frames else [])

    def run_meta(self, run_id: str) -> dict[str, Any]:
        """One run's row of the runs table as a dict (missing values left out, the model's
        ``sizes`` decoded), read from that run's file alone; an unknown run is a TraceError
        that says how to list them."""
        path = self._run_file(check_run_id(run_id))
        if not path.is_file():
            raise TraceError(f"{self.root}: no run {run_id!r} (vpipe runs {self.root} lists them)")
        row = runs_frame(read_parquet(path)[0])
        meta = {k: v for k, v in row.iloc[0].items() if not pd.isna(v)}
        if isinstance(meta.get("sizes"), str):
            meta["sizes"] = json.loads(meta["sizes"])
        return meta

    def run(self, run_id: str) -> StoredRun:
        """One run as stored: its runs-table row, events and memory samples, reading only that
        run's files."""
        meta = self.run_meta(run_id)
        return StoredRun(meta, self.events([run_id]), self.memory([run_id]))

    def events(self, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
        """Event table of the given committed runs (all by default)."""
        return events_frame(self._read_table("events", run_ids))

    def memory(self, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
        """Memory samples of the given committed runs (all by default)."""
        return memory_frame(self._read_table("memory", run_ids))

    def _read_table(self, table: str, run_ids: Iterable[str] | None) -> pd.DataFrame | dict:
        committed = self.run_ids()
        wanted = committed if run_ids is None else list(run_ids)
        unknown = [r for r in wanted if r not in committed]
        if unknown:
            raise TraceError(f"{self.root}: no run {unknown[0]!r} in the store")
        columns = EVENT_COLUMNS if table == "events" else MEMORY_COLUMNS
        frames = []
        for run_id in wanted:
            for path in sorted(
                (self.root / table / f"run_id={run_id}").glob("rank=*/part-0.parquet")
            ):
                df, meta = read_parquet(path)
                df["run_id"] = run_id
                df["rank"] = int(meta.get("rank", path.parent.name.split("=", 1)[1]))
                frames.append(df)
        if not frames:
            return {c: [] for c in columns}
        return pd.concat(frames, ignore_index=True)
