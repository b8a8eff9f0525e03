"""A ``vpipe bench`` output read back as the tables the sweep produced.

:func:`load_bench` rebuilds :class:`vpipe.sweep.results.BenchResults` from an output directory
(its ``meta.json``, steps and ranks tables and results store), so that the report's sections
that weigh the sweep's measurements against its predictions (the plan and its errors) can be
made again from stored results, without running the sweep.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from vpipe.sweep.driver import SweepSpec
from vpipe.sweep.results import BenchResults

__all__ = ["load_bench"]


def load_bench(path: str | Path) -> BenchResults | None:
    """The sweep stored in ``path`` (a ``vpipe bench`` output; with ``--append``, the last
    sweep, whose ``meta.json`` and steps it holds), events and memory of its measured runs
    included; None when ``path`` is not one (no ``meta.json`` or steps table)."""
    from vpipe.report.comparison import load_host
    from vpipe.trace.store import Store

    path = Path(path)
    if not (path / "steps.parquet").is_file():
        return None
    meta = load_host(path)[1]  # an unreadable meta.json: one line naming it
    if meta is None:
        return None
    fields = {f.name for f in dataclasses.fields(SweepSpec)}
    spec = SweepSpec(**{k: tuple(v) if isinstance(v, list) else v
                        for k, v in meta.items() if k in fields})  # fmt: skip
    store = Store(path)
    runs = store.runs()
    if meta.get("bench_id"):  # --append: the store holds earlier sweeps too; meta.json the last
        runs = runs[(runs["bench_id"] == meta["bench_id"]).fillna(False).astype(bool)]
    ids = [str(r) for r in runs.loc[runs["source"] == "measured", "run_id"]]
    events = store.events(ids)
    memory = store.memory(ids)
    ranks_path = path / "ranks.parquet"
    return BenchResults(
        spec,
        str(meta.get("bench_id", "")),
        meta,
        runs,
        pd.read_parquet(path / "steps.parquet"),
        pd.read_parquet(ranks_path) if ranks_path.is_file() else pd.DataFrame(),
        {str(k): g for k, g in events.groupby("run_id", observed=True)},
        {str(k): g for k, g in memory.groupby("run_id", observed=True)},
    )
