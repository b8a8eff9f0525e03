"""Which files of a directory are traces: others are skipped and named in one line, a named
non-trace is refused with its name, and ranks that disagree (world size, steps) are named."""

import json

import pytest

from vpipe.cli import main
from vpipe.errors import TraceError
from vpipe.trace.kineto import convert


def _torch_style(path, rank: int, world: int = 2, step: int = 2) -> None:
    """A minimal trace as torch's runtime writes it: a step, one action, one operator."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": rank,
         "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": f"PP:{rank}F0", "pid": rank, "tid": 1,
         "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": rank, "tid": 1, "ts": 600,
         "dur": 400},
    ]  # fmt: skip
    dist = {"rank": rank, "world_size": world}
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": dist}))


def test_directory_skips_non_traces_and_names_them(tmp_path):
    for r in (0, 1):
        _torch_style(tmp_path / f"rank{r}_trace.json", r)
    (tmp_path / "job_config.json").write_text(json.dumps({"lr": 0.1}))
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.warns(UserWarning, match=r"skipped 2 files that are not a trace: empty.json, job"):
        tr = convert([tmp_path])
    assert tr.meta["ranks"] == 2 and tr.meta["ranks_in_trace"] == [0, 1]
    wait = tr.events[tr.events["kind"] == "WAIT"]
    assert list(wait["end_ns"] - wait["start_ns"]) == [600_000, 600_000]  # before the operator


@pytest.mark.parametrize("content", ["[1, 2, 3]", '{"traceEvents": []}', '{"a": 1}', "[]"])
def test_a_named_non_trace_is_refused_with_its_name(tmp_path, capsys, content):
    bad = tmp_path / "not_a_trace.json"
    bad.write_text(content)
    assert main(["trace", str(bad), "-o", str(tmp_path / "ev.parquet")]) != 0
    err = capsys.readouterr().err
    assert "not_a_trace.json" in err and "not a" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ev.parquet").exists()


def test_ranks_that_disagree_are_named(tmp_path):
    _torch_style(tmp_path / "rank0_trace.json", 0, world=2)
    _torch_style(tmp_path / "rank1_trace.json", 1, world=4)
    with pytest.raises(TraceError, match="rank1_trace.json has world size 4, rank0_trace.json 2"):
        convert([tmp_path])
    _torch_style(tmp_path / "rank1_trace.json", 1, step=3)
    with pytest.raises(TraceError, match=r"rank1_trace.json profiled steps \[3\], rank0"):
        convert([tmp_path])
