"""Which files make up one run's traces, which rank each is, and whether they agree.

A directory may hold other JSON beside the traces (a job's config, a results file): those are
skipped and named in one warning; a file given by name that is not a trace is refused. The
files of one run agree on the world size (``distributedInfo``) and on the profiled steps;
where they do not, the error names the files.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vpipe.errors import TraceError
from vpipe.trace.kineto_json import NotATrace, RawTrace, read_trace

_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


def trace_files(paths: Iterable[str | os.PathLike[str]]) -> list[tuple[Path, bool]]:
    """(file, whether it was found in a directory) of every candidate trace file: the given
    files, and a directory's ``*.json`` / ``*.json.gz`` (sorted, hidden ones left out)."""
    out: list[tuple[Path, bool]] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.name.endswith(_SUFFIXES))
            if not found:
                raise TraceError(
                    f"{p}: no trace files (*.json, *.json.gz) in this directory" + _subdirs_hint(p)
                )
            out.extend((q, True) for q in found if not q.name.startswith("."))
        elif p.exists():
            out.append((p, False))
        else:
            raise TraceError(f"{p}: no such trace file or directory")
    return out


_SUFFIXES = (".json", ".json.gz")


def _subdirs_hint(p: Path) -> str:
    """Where a directory's subdirectories hold trace files (torchtitan writes one per profiled
    iteration, ``iteration_10/``), the hint naming them."""
    held = sorted(
        q.name
        for q in p.iterdir()
        if q.is_dir() and any(f.name.endswith(_SUFFIXES) for f in q.iterdir())
    )
    if not held:
        return ""
    shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
    return f"; its subdirector{'ies' if len(held) > 1 else 'y'} {shown} hold some: give one"


def read_traces(paths: Iterable[str | os.PathLike[str]]) -> list[tuple[Path, RawTrace]]:
    """The traces among ``paths``; a directory's files that are not traces are skipped and
    named in one warning, a named file that is not one is an error."""
    read, skipped = [], []
    for path, in_dir in trace_files(paths):
        try:
            read.append((path, read_trace(path)))
        except NotATrace:
            if not in_dir:
                raise
            skipped.append(path.name)
    if skipped:
        warnings.warn(
            f"skipped {len(skipped)} file{'s' if len(skipped) > 1 else ''} that "
            f"{'are' if len(skipped) > 1 else 'is'} not a trace: {', '.join(skipped)}",
            stacklevel=3,
        )
    if not read:
        raise TraceError(f"no trace among {', '.join(skipped) or 'the files given'}")
    return read


def rank_of(path: Path, header: Mapping[str, Any], n_files: int) -> int:
    """A file's rank: vpipe's metadata, else ``distributedInfo``, else ``rank<N>`` in its name."""
    meta = header.get("vpipe") or {}
    if isinstance(meta, dict) and "rank" in meta:
        return int(meta["rank"])
    dist = header.get("distributedInfo")
    if isinstance(dist, dict) and "rank" in dist:
        return int(dist["rank"])
    m = _RANK_IN_NAME.search(path.name)
    if m:
        return int(m.group(1))
    if n_files == 1:
        return 0
    raise TraceError(f"{path}: cannot tell its rank (no metadata, no rank<N> in the file name)")


def by_rank(traces: Iterable[tuple[Path, RawTrace]]) -> dict[int, tuple[Path, RawTrace]]:
    """The traces keyed by their rank (:func:`rank_of`); an error naming two files of one rank."""
    traces = list(traces)
    out: dict[int, tuple[Path, RawTrace]] = {}
    for path, raw in traces:
        rank = rank_of(path, raw.header, len(traces))
        if rank in out:
            raise TraceError(f"{path}: rank {rank} also comes from {out[rank][0]}")
        out[rank] = (path, raw)
    return out


def world_size(files: Mapping[int, tuple[Path, Mapping[str, Any]]]) -> int | None:
    """The world size the files' ``distributedInfo`` states (None if none does); an error
    naming two files that disagree, or a rank outside it."""
    sizes = {}
    for path, header in files.values():
        dist = header.get("distributedInfo")
        if isinstance(dist, dict) and "world_size" in dist:
            sizes[path] = int(dist["world_size"])
    if not sizes:
        return None
    (p0, w0), *rest = sizes.items()
    for p, w in rest:
        if w != w0:
            raise TraceError(
                f"{p.name} has world size {w}, {p0.name} {w0}: traces of different runs"
            )
    for rank, (path, _) in files.items():
        if rank >= w0:
            raise TraceError(f"{path}: rank {rank} outside the world size {w0} of the traces")
    return w0


def check_steps(steps: Mapping[int, tuple[Path, list[int]]]) -> None:
    """An error naming two ranks' files whose profiled steps differ."""
    items = sorted(steps.items())
    for (_, (p0, s0)), (_, (p, s)) in zip(items, items[1:], strict=False):
        if s != s0:
            raise TraceError(
                f"{p.name} profiled steps {s}, {p0.name} steps {s0}: the ranks' traces "
                "disagree (different runs or profiler schedules)"
            )


def merged_meta(metas: Sequence[tuple[Path, Mapping[str, Any], bool]]) -> dict[str, Any]:
    """Combine per-rank metadata; a disagreeing run_id is an error (files of different runs)."""
    out: dict[str, Any] = {}
    for path, meta, _ in metas:
        for k, v in meta.items():
            if k == "rank":
                continue
            if k == "run_id" and "run_id" in out and out["run_id"] != v:
                raise TraceError(
                    f"{path}: run_id {v!r} differs from {out['run_id']!r} of the other files"
                )
            out.setdefault(k, v)
    return out
