"""The Parquet results store: round trip, schema version, atomic append-only writes."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import vpipe.trace.store as store_mod
from vpipe.errors import TraceError
from vpipe.events import EVENT_COLUMNS, events_frame, memory_frame
from vpipe.trace.store import Store


def make_events(run_id: str, ranks: int = 2, n: int = 50) -> pd.DataFrame:
    rows = []
    for r in range(ranks):
        for i in range(n):
            rows.append(
                dict(run_id=run_id, source="measured", impl="vpipe", schedule="1f1b", rank=r,
                     step=i // 10, stage=r, microbatch=i % 10, kind="F", name=f"{r}F{i % 10}",
                     start_ns=1000 * i, end_ns=1000 * i + 500)
            )  # fmt: skip
    return events_frame(rows)


def make_memory(run_id: str) -> pd.DataFrame:
    return memory_frame(
        dict(run_id=[run_id] * 4, source="measured", rank=[0, 0, 1, 1], step=0,
             t_ns=[1, 2, 3, 4], bytes=[10, 20, 30, 40], what="cpu_allocated")
    )  # fmt: skip


def test_round_trip_and_partition_layout(tmp_path):
    st = Store(tmp_path)
    for rid in ("a", "b"):
        st.append_run({"run_id": rid, "schedule": "1f1b", "step_time_s": 0.5, "note": "x"},
                      make_events(rid), make_memory(rid))  # fmt: skip
    assert st.run_ids() == ["a", "b"]
    runs = st.runs()
    assert list(runs["run_id"]) == ["a", "b"] and list(runs["note"]) == ["x", "x"]
    assert list(runs.columns[: len(store_mod.RUN_COLUMNS)]) == list(store_mod.RUN_COLUMNS)
    ev = st.events(["b"])
    assert list(ev.columns) == list(EVENT_COLUMNS)
    assert ev.dtypes.to_dict() == make_events("b").dtypes.to_dict()
    key = ["rank", "start_ns"]
    pd.testing.assert_frame_equal(
        ev.sort_values(key).reset_index(drop=True),
        make_events("b").sort_values(key).reset_index(drop=True),
        check_categorical=False,
    )
    assert len(st.events()) == 200 and len(st.memory(["a"])) == 4
    f = tmp_path / "events" / "run_id=a" / "rank=1" / "part-0.parquet"
    meta = pq.ParquetFile(f)
    assert meta.metadata.row_group(0).column(0).compression == "ZSTD"
    assert json.loads(meta.schema_arrow.metadata[b"vpipe"])["schema_version"] >= 1
    # the datasets are plain Hive-partitioned Parquet for other tools
    assert len(pd.read_parquet(tmp_path / "events")) == 200
    assert len(pd.read_parquet(tmp_path / "runs")) == 2


def test_bad_ids_duplicates_and_unknown_runs(tmp_path):
    st = Store(tmp_path)
    st.append_run({"run_id": "a"}, make_events("a"))
    with pytest.raises(TraceError, match="already in the store"):
        st.append_run({"run_id": "a"}, make_events("a"))
    with pytest.raises(TraceError, match="invalid run id"):
        st.append_run({"run_id": "../x"})
    with pytest.raises(TraceError, match="belong to runs"):
        st.append_run({"run_id": "c"}, make_events("d"))
    with pytest.raises(TraceError, match="no run 'zz'"):
        st.events(["zz"])
    assert st.run_ids() == ["a"]


def test_newer_schema_version_is_a_clear_error(tmp_path, monkeypatch):
    st = Store(tmp_path)
    monkeypatch.setattr(store_mod, "SCHEMA_VERSION", store_mod.SCHEMA_VERSION + 1)
    st.append_run({"run_id": "future"}, make_events("future"))
    monkeypatch.undo()
    with pytest.raises(TraceError, match=r"run_id=future\.parquet: written with vpipe schema"):
        st.runs()


def test_interrupted_write_leaves_store_complete(tmp_path, monkeypatch):
    st = Store(tmp_path)
    st.append_run({"run_id": "good"}, make_events("good"), make_memory("good"))
    real_write = pq.write_table

    def failing_write(table, where, **kw):
        if "runs" in str(where):  # die while writing the commit file, after a partial write
            with open(where, "wb") as f:
                f.write(b"PAR1 half")
            raise KeyboardInterrupt("killed")
        real_write(table, where, **kw)

    monkeypatch.setattr(store_mod.pq, "write_table", failing_write)
    with pytest.raises(KeyboardInterrupt):
        st.append_run({"run_id": "bad"}, make_events("bad"), make_memory("bad"))
    monkeypatch.undo()
    assert st.run_ids() == ["good"]
    assert len(st.events()) == 100 and set(st.events()["run_id"]) == {"good"}
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]
    # the interrupted run can be written again from scratch
    st.append_run({"run_id": "bad"}, make_events("bad", ranks=1))
    assert len(st.events(["bad"])) == 50


def test_killed_writer_never_leaves_a_partial_run(tmp_path):
    """SIGKILL a process appending runs at some point: every visible run is complete."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        from test_store import make_events, make_memory
        from vpipe.trace.store import Store
        st = Store({str(tmp_path)!r})
        for i in range(1000):
            st.append_run({{"run_id": f"r{{i}}"}}, make_events(f"r{{i}}", ranks=4), make_memory(f"r{{i}}"))
            if i == 1:
                print("go", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "go"
        import time

        time.sleep(float(np.random.default_rng().uniform(0.05, 0.5)))
    finally:
        proc.kill()
        proc.wait()
    st = Store(tmp_path)
    ids = st.run_ids()
    assert len(ids) >= 2
    ev = st.events()
    counts = ev.groupby("run_id", observed=True).size()
    assert set(counts.index) == set(ids) and (counts == 200).all()
    assert (st.memory().groupby("run_id", observed=True).size() == 4).all()
    assert len(st.runs()) == len(ids)


def _named_events(run_id: str, n_names: int):
    from vpipe.events import events_frame

    return events_frame(
        {
            "run_id": [run_id] * n_names, "source": ["measured"] * n_names,
            "impl": ["vpipe"] * n_names, "schedule": ["zbv"] * n_names,
            "rank": [0] * n_names, "step": [0] * n_names, "stage": [0] * n_names,
            "microbatch": list(range(n_names)), "kind": ["F"] * n_names,
            "name": [f"0F{m}" for m in range(n_names)],
            "start_ns": list(range(n_names)), "end_ns": list(range(1, n_names + 1)),
        }
    )  # fmt: skip


def test_many_names_read_as_one_dataset_by_pandas_and_pyarrow(tmp_path):
    """Runs with few and with many distinct names (int8 and int16 category codes in pandas)
    read back together through pandas and pyarrow.dataset with hive partitioning."""
    import pyarrow.dataset as ds

    st = Store(tmp_path)
    sizes = {"a": 20, "b": 310, "c": 100}
    for rid, n in sizes.items():
        st.append_run({"run_id": rid}, _named_events(rid, n))
    ev = pd.read_parquet(tmp_path / "events")
    assert len(ev) == sum(sizes.values()) and ev["name"].nunique() == 310
    table = ds.dataset(tmp_path / "events", format="parquet", partitioning="hive").to_table()
    assert table.num_rows == sum(sizes.values())
    assert sorted(set(table.column("run_id").to_pylist())) == ["a", "b", "c"]


def test_old_store_reads_through_vpipe_and_upgrades(tmp_path):
    """A store written by schema version 1 (narrow category codes) reads through the Store
    API, and `vpipe runs --upgrade` rewrites it so pandas reads it directly."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from vpipe.cli import main

    st = Store(tmp_path)
    for rid, n in (("a", 20), ("b", 200)):
        st.append_run({"run_id": rid}, _named_events(rid, n))
        path = tmp_path / "events" / f"run_id={rid}" / "rank=0" / "part-0.parquet"
        old = pa.Table.from_pandas(_named_events(rid, n).drop(columns=["run_id", "rank"]))
        meta = {b"vpipe": json.dumps({"table": "events", "run_id": rid, "rank": 0,
                                      "schema_version": 1}).encode()}  # fmt: skip
        pq.write_table(old.replace_schema_metadata(meta), path)  # as version 1 wrote it
    with pytest.raises(Exception, match="not in range"):
        pd.read_parquet(tmp_path / "events")
    assert len(st.events()) == 220  # vpipe reads file by file
    assert main(["runs", str(tmp_path), "--upgrade"]) == 0
    assert len(pd.read_parquet(tmp_path / "events")) == 220
    assert Store(tmp_path).upgrade() == 0  # nothing left to rewrite


def test_committed_baseline_reads_with_pandas():
    """The README's way to read a store works on the committed baseline."""
    from pathlib import Path

    root = Path(__file__).parent.parent / "results" / "baseline"
    for table in ("runs", "events", "memory"):
        assert len(pd.read_parquet(root / table)) > 0
