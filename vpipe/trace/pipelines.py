"""Which traced ranks form one pipeline, in a job that runs several of them.

Real jobs replicate the pipeline (data, sharded-data, tensor or context parallel), and their
traces are one file per global rank: a job of pipeline size P and 4 replicas writes 4P files,
and a pipeline's ranks need not be consecutive (torchtitan's mesh puts ``pp`` outermost, so
with 4 replicas the pipeline of rank 0 is ranks 0 and 4). Analysis, prediction and the program
inferred from a trace all read one pipeline, its ranks numbered 0..P-1 in pipeline order.

Where the pipelines come from:

- **the traces' headers**: torch.profiler writes the process groups each rank belongs to in
  ``distributedInfo.pg_config`` (name, description, ranks). A ``DeviceMesh`` dimension named
  ``pp`` is the group described ``mesh_pp`` (torchtitan's and vpipe's own ``--dp`` runs). A
  group whose description has ``pp``, ``pipe`` or ``pipeline`` as a word is the file's pipeline,
  and its ranks are listed in pipeline-rank order.
- **else what the ranks ran**: ranks that ran the same stages are replicas of one another; the
  k-th of each set (by global rank) belong to pipeline k, in the order of their first stage.

:meth:`Pipelines.choose` picks one (the one holding the lowest global rank, else ``--pipeline
K`` counting in that order) and says in one line what was read and what was left.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from vpipe.errors import TraceError
from vpipe.events import COMPUTE_KINDS

__all__ = ["Pipelines", "by_stages", "from_headers", "from_stages", "pick", "pipeline_group"]

PIPELINE_WORDS = frozenset({"pp", "pipe", "pipeline"})


@dataclass(frozen=True)
class Pipelines:
    """The pipelines among a run's traced ranks: each one's global ranks in pipeline-rank
    order, sorted by their lowest member, and where that was read (for the note)."""

    groups: tuple[tuple[int, ...], ...]
    source: str

    def trivial(self) -> bool:
        """Whether the traces are one pipeline whose global ranks are its pipeline ranks."""
        return len(self.groups) == 1 and self.groups[0] == tuple(range(len(self.groups[0])))

    def choose(self, index: int | None, n_files: int) -> tuple[dict[int, int], str]:
        """Global rank -> pipeline rank of pipeline ``index`` (None: the first), and the line
        that says what was read; an error naming the range for an index outside it."""
        k = 0 if index is None else index
        n = len(self.groups)
        if not 0 <= k < n:
            raise TraceError(
                f"--pipeline {k}: the traces hold {n} pipeline{'s' if n > 1 else ''} "
                f"({self.source}), numbered 0-{n - 1}"
            )
        group = self.groups[k]
        ranks = ", ".join(map(str, group))
        read = f"global ranks {ranks} read as ranks 0-{len(group) - 1}"
        if n == 1:
            return _mapping(group), f"one pipeline of a larger job ({self.source}): {read}"
        return _mapping(group), (
            f"{n_files} traces hold {n} pipelines of {len(group)} ranks ({self.source}): "
            f"pipeline {k}, {read}; --pipeline 0-{n - 1} reads another"
        )


def _mapping(group: tuple[int, ...]) -> dict[int, int]:
    return {g: i for i, g in enumerate(group)}


def pipeline_group(
    header: Mapping[str, Any], rank: int | None = None
) -> tuple[str, tuple[int, ...]] | None:
    """A trace's pipeline process group from its ``distributedInfo.pg_config``: (its
    description, its global ranks in order), or None when the header names none or several;
    with ``rank``, among the groups that hold it (a header that lists other ranks' too)."""
    dist = header.get("distributedInfo")
    configs = dist.get("pg_config") if isinstance(dist, dict) else None
    if isinstance(configs, dict):  # keyed by group name in some versions
        configs = list(configs.values())
    if not isinstance(configs, list):
        return None
    found = []
    for cfg in configs:
        if not isinstance(cfg, dict):
            continue
        desc = str(cfg.get("pg_desc") or "")
        words = set(re.split(r"[^a-z0-9]+", desc.lower()))
        ranks = cfg.get("ranks")
        if words & PIPELINE_WORDS and isinstance(ranks, list) and ranks:
            members = tuple(int(r) for r in ranks)
            if rank is None or rank in members:
                found.append((desc, members))
    distinct = {ranks for _, ranks in found}
    return found[0] if len(distinct) == 1 else None  # none, or ambiguous


def from_headers(headers: Mapping[int, tuple[Path, Mapping[str, Any]]]) -> Pipelines | None:
    """The pipelines the files' headers name (global rank -> (file, header)); None when no file
    names its pipeline group. An error naming the files where some do and some do not, where a
    file's group leaves its own rank out, or where two files' groups overlap but differ."""
    named = {
        r: (path, pipeline_group(h, r) or pipeline_group(h)) for r, (path, h) in headers.items()
    }
    have = {r: v for r, v in named.items() if v[1] is not None}
    if not have:
        return None
    if len(have) < len(named):
        path = next(p for r, (p, g) in sorted(named.items()) if g is None)
        other, (desc, ranks) = next(iter(sorted(have.items())))[1]
        raise TraceError(
            f"{path.name} names no pipeline group in its distributedInfo, {other.name} names "
            f"{desc!r} {list(ranks)}: traces of different runs"
        )
    groups: dict[tuple[int, ...], Path] = {}
    for r, (path, (_, ranks)) in sorted(have.items()):
        if r not in ranks:
            raise TraceError(f"{path.name}: rank {r} is not in its pipeline group {list(ranks)}")
        for g, other in groups.items():
            if g != ranks and set(g) & set(ranks):
                raise TraceError(
                    f"{path.name}'s pipeline group {list(ranks)} overlaps {other.name}'s "
                    f"{list(g)}: traces of different runs"
                )
        groups.setdefault(ranks, path)
    descs = sorted({desc for _, (_, (desc, _)) in have.items()})
    source = f"process group{'s' if len(descs) > 1 else ''} {', '.join(map(repr, descs))}"
    return Pipelines(tuple(sorted(groups, key=min)), source)


def from_stages(stages: Mapping[int, Iterable[int]]) -> Pipelines | None:
    """Pipelines from the stages each traced rank ran (global rank -> stages): None when no two
    ranks ran the same stages (one pipeline); an error when the ranks that did do not pair up
    into whole pipelines."""
    by_set: dict[frozenset[int], list[int]] = {}
    for r, s in sorted(stages.items()):
        by_set.setdefault(frozenset(s), []).append(r)
    if all(len(rs) == 1 for rs in by_set.values()) or frozenset() in by_set:
        return None  # one pipeline, or a rank whose stages are not named: nothing to tell by
    counts = {len(rs) for rs in by_set.values()}
    n_stages = sum(len(s) for s in by_set)
    if len(counts) > 1 or len(set().union(*by_set)) < n_stages:
        shown = "; ".join(
            f"stages {sorted(s)} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
            for s, rs in sorted(by_set.items(), key=lambda kv: min(kv[0], default=-1))
        )
        raise TraceError(
            f"the traces hold several pipelines that do not pair up ({shown}): give the files "
            "of one pipeline"
        )
    ordered = sorted(by_set.items(), key=lambda kv: min(kv[0]))
    groups = tuple(tuple(rs[j] for _, rs in ordered) for j in range(counts.pop()))
    return Pipelines(tuple(sorted(groups, key=min)), "the stages each rank ran")


def pick(
    pipes: Pipelines | None, index: int | None, n_files: int
) -> tuple[dict[int, int] | None, str | None]:
    """Global rank -> pipeline rank of the chosen pipeline and its note; (None, None) where the
    traces are one pipeline numbered as it is (``index`` must then be 0 or None)."""
    if pipes is None or pipes.trivial():
        if index:
            raise TraceError(f"--pipeline {index}: the traces hold one pipeline, numbered 0")
        return None, None
    return pipes.choose(index, n_files)


def by_stages(
    events: pd.DataFrame, memory: pd.DataFrame, index: int | None, n_files: int
) -> tuple[pd.DataFrame, pd.DataFrame, dict[int, int] | None, str | None]:
    """The event and memory tables of one pipeline, told apart by the stages each rank ran
    (:func:`from_stages`), its ranks renumbered, with the mapping and note of :func:`pick`;
    unchanged where the ranks are one pipeline."""
    compute = events[events["kind"].astype(str).isin(COMPUTE_KINDS) & (events["stage"] >= 0)]
    stages = {int(r): set() for r in events["rank"].unique()}
    for r, g in compute.groupby("rank"):
        stages[int(r)] = set(g["stage"].astype(int))
    mapping, note = pick(from_stages(stages), index, n_files)
    if mapping is None:
        return events, memory, None, None

    def renumbered(table: pd.DataFrame) -> pd.DataFrame:
        table = table[table["rank"].isin(list(mapping))].copy()
        table["rank"] = table["rank"].map(mapping).astype(table["rank"].dtype)
        return table

    return renumbered(events), renumbered(memory), mapping, note
