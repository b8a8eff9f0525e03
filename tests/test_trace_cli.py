"""``vpipe trace``: Kineto JSON to Parquet (file and store), errors as one line."""

import json

import pandas as pd
import pyarrow.parquet as pq

from vpipe.cli import main
from vpipe.events import EVENT_COLUMNS
from vpipe.ir import actions_from_strings
from vpipe.trace.store import Store
from vpipe.trace.synth import write_synthetic_run

PROGRAMS = actions_from_strings(
    [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
)
META = {
    "run_id": "cli1",
    "schedule": "1f1b",
    "impl": "vpipe",
    "ranks": 2,
    "batch": 8,
    "microbatches": 1,
}


def test_trace_to_parquet_file_and_store(tmp_path, capsys):
    write_synthetic_run(tmp_path / "tr", PROGRAMS, steps=[0, 1, 2], meta=META)
    out = tmp_path / "ev.parquet"
    assert (
        main(["trace", str(tmp_path / "tr"), "-o", str(out), "--store", str(tmp_path / "st")]) == 0
    )
    assert "trace events" in capsys.readouterr().out
    ev = pd.read_parquet(out)
    assert list(ev.columns) == list(EVENT_COLUMNS) and len(ev) > 0
    assert set(ev["run_id"]) == {"cli1"}
    f = pq.ParquetFile(out)
    assert f.metadata.row_group(0).column(0).compression == "ZSTD"
    assert str(f.schema_arrow.field("kind").type).startswith("dictionary")
    assert json.loads(f.schema_arrow.metadata[b"vpipe"])["run_id"] == "cli1"
    assert len(pd.read_parquet(tmp_path / "ev.memory.parquet")) > 0
    st = Store(tmp_path / "st")
    runs = st.runs()
    assert list(runs["run_id"]) == ["cli1"] and runs.loc[0, "schedule"] == "1f1b"
    # a trace holds profiled steps only: their step time carries its own name, and the step
    # time and throughput of timed steps are missing rather than the profiled ones renamed
    assert runs.loc[0, "profiled_step_time_s"] > 0
    assert pd.isna(runs.loc[0, "step_time_s"]) and pd.isna(runs.loc[0, "samples_per_s"])
    assert len(st.events()) == len(ev)


def test_bad_trace_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "rank0.json"
    bad.write_text('{"traceEvents": [{"name": "PP:0F0", "ph": "X", "ts": 1')
    assert main(["trace", str(bad), "-o", str(tmp_path / "x.parquet")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rank0.json" in err and "truncated" in err
    assert not (tmp_path / "x.parquet").exists()


def test_analyze_prints_metrics_and_predictions(tmp_path, capsys):
    write_synthetic_run(tmp_path / "tr", PROGRAMS, steps=[0, 1, 2], meta=META)
    assert main(["trace", str(tmp_path / "tr"), "--store", str(tmp_path / "st")]) == 0
    capsys.readouterr()
    assert (
        main(["analyze", str(tmp_path / "st"), "--predict", "zbv", "gpipe=" + str(tmp_path / "tr")])
        == 0
    )
    out = capsys.readouterr().out
    assert "profiled step " in out and "bubble ratio" in out and "calibrated on cli1" in out
    assert "per message posted" not in out  # a trace holds no communication threads' CPU
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    assert "zbv" in lines and "gpipe" in lines and "1f1b" in lines
    # a store of one run, or a trace alone: no other config to measure the error on
    alone = "predicted step times: error unknown: one config measured (the run belongs to no sweep)"
    assert alone in out
    assert main(["analyze", str(tmp_path / "tr"), "--predict", "zbv"]) == 0
    out = capsys.readouterr().out
    assert "predicted step times: error unknown: a single trace has no cross-config fidelity" in out
    # a trace has no timed steps: its profiled steps give the level the compute is anchored to
    assert "anchored to the run's profiled median" in out
    # the flag repeated adds to the list (it kept only the last)
    trace = str(tmp_path / "tr")
    assert main(["analyze", trace, "--predict", "zbv", "--predict", "gpipe=" + trace]) == 0
    lines = {ln.split()[0] for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    assert {"zbv", "gpipe"} <= lines
    assert main(["analyze", str(tmp_path / "st"), "--run", "nope"]) == 2
