"""Traces of a job that runs several pipelines (data-parallel replicas): one pipeline is read,
its global ranks renumbered in pipeline order, from the profiler's process groups or else from
the stages each rank ran (vpipe.trace.pipelines).

The end-to-end tests record a torch job as torchtitan lays one out (bench.torch_traces --dp 2:
a ("pp", "dp") mesh, so the pipeline of rank 0 is ranks 0 and 2) with torch's own classes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_torch_own_traces import independent_bubble

from bench.torch_traces import record
from vpipe.cli import main
from vpipe.errors import TraceError
from vpipe.metrics.per_run import rank_metrics
from vpipe.trace.kineto import convert
from vpipe.trace.pipelines import Pipelines, from_headers, from_stages, pick, pipeline_group


def _header(rank: int, *groups: tuple[str, list[int]]) -> dict:
    configs = [{"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1, 2, 3]}]
    configs += [
        {"pg_name": str(i + 1), "pg_desc": d, "ranks": r} for i, (d, r) in enumerate(groups)
    ]
    return {"distributedInfo": {"rank": rank, "world_size": 4, "pg_config": configs}}


def test_a_headers_pipeline_group_is_the_one_named_pp():
    assert pipeline_group(_header(2, ("mesh_dp", [0, 2]), ("mesh_pp", [2, 3]))) == (
        "mesh_pp",
        (2, 3),
    )
    assert pipeline_group(_header(0, ("pipeline_parallel", [0, 4]))) == (
        "pipeline_parallel",
        (0, 4),
    )
    # "dp_shard_cp" has no "pp" word; a default group alone names no pipeline
    assert pipeline_group(_header(0, ("mesh_dp_shard_cp", [0, 1]))) is None
    assert pipeline_group({"distributedInfo": {"rank": 0, "world_size": 2}}) is None
    assert pipeline_group({}) is None
    # two different groups that both say pp: ambiguous, so none
    assert pipeline_group(_header(0, ("mesh_pp", [0, 2]), ("pp_other", [0, 1]))) is None
    # a header that lists every pipeline: the one holding the file's rank
    both = _header(3, ("mesh_pp", [0, 2]), ("mesh_pp", [1, 3]))
    assert pipeline_group(both, 3) == ("mesh_pp", (1, 3)) and pipeline_group(both) is None


def test_pipelines_from_headers_and_their_errors():
    files = {r: (Path(f"rank{r}_trace.json"), _header(r, ("mesh_pp", [r % 2, r % 2 + 2])))
             for r in range(4)}  # fmt: skip
    pipes = from_headers(files)
    assert pipes.groups == ((0, 2), (1, 3)) and "'mesh_pp'" in pipes.source
    mapping, note = pipes.choose(1, 4)
    assert mapping == {1: 0, 3: 1}
    assert (
        "4 traces hold 2 pipelines of 2 ranks" in note and "pipeline 1, global ranks 1, 3" in note
    )
    with pytest.raises(TraceError, match=r"--pipeline 2: the traces hold 2 pipelines .* 0-1"):
        pipes.choose(2, 4)

    no_group = {**files, 3: (Path("rank3_trace.json"), _header(3))}
    with pytest.raises(TraceError, match="rank3_trace.json names no pipeline group"):
        from_headers(no_group)
    outside = {0: (Path("rank0_trace.json"), _header(0, ("mesh_pp", [1, 2])))}
    with pytest.raises(TraceError, match="rank 0 is not in its pipeline group"):
        from_headers(outside)
    overlap = {0: (Path("a.json"), _header(0, ("mesh_pp", [0, 2]))),
               1: (Path("b.json"), _header(1, ("mesh_pp", [1, 2])))}  # fmt: skip
    with pytest.raises(TraceError, match="overlaps a.json's"):
        from_headers(overlap)


def test_one_pipeline_numbered_as_it_is_needs_no_choice():
    whole = Pipelines(((0, 1),), "x")
    assert whole.trivial() and pick(whole, None, 2) == (None, None)
    with pytest.raises(TraceError, match="--pipeline 1: the traces hold one pipeline"):
        pick(whole, 1, 2)
    part = Pipelines(((0, 4),), "process group 'mesh_pp'")  # the files of rank 0's pipeline
    mapping, note = pick(part, None, 2)
    assert mapping == {0: 0, 4: 1} and note.startswith("one pipeline of a larger job")


def test_pipelines_from_the_stages_each_rank_ran():
    # a V placement, two replicas laid out as torchtitan's ("pp", "dp") mesh
    assert from_stages({0: {0, 3}, 1: {0, 3}, 2: {1, 2}, 3: {1, 2}}).groups == ((0, 2), (1, 3))
    # vpipe's own ("dp", "pp") layout: replica-major
    assert from_stages({0: {0}, 1: {1}, 2: {0}, 3: {1}}).groups == ((0, 1), (2, 3))
    assert from_stages({0: {0, 2}, 1: {1, 3}}) is None  # one pipeline
    assert from_stages({0: set(), 1: set()}) is None  # stages not named: nothing to tell by
    with pytest.raises(TraceError, match=r"do not pair up \(stages \[0\] on ranks 0, 2; "):
        from_stages({0: {0}, 1: {1}, 2: {0}})


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """ZBVZeroBubble and 1F1B at P=2 with two replicas: four ranks, one trace each."""
    return record(tmp_path_factory.mktemp("dp"), 2, ["ZBVZeroBubble", "1F1B"], microbatches=4,
                  blocks=1, wait=0, dp=2)  # fmt: skip


def _without_groups(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.glob("*.json"):
        d = json.loads(f.read_text())
        del d["distributedInfo"]["pg_config"]
        (dst / f.name).write_text(json.dumps(d))
    return dst


@pytest.mark.parametrize("pipeline, global_ranks", [(None, [0, 2]), (1, [1, 3])])
def test_a_replicated_torch_job_reads_one_pipeline(job, pipeline, global_ranks):
    d = job / "ZBVZeroBubble"
    tr = convert([d], pipeline=pipeline)
    assert tr.meta["ranks"] == 2 and tr.meta["global_ranks"] == global_ranks
    assert tr.meta["schedule"] == "zbv" and tr.meta["stages"] == 4
    assert tr.meta["microbatches"] == 4 and tr.meta["ranks_in_trace"] == [0, 1]
    assert "4 traces hold 2 pipelines of 2 ranks (process group 'mesh_pp')" in tr.meta["note"]
    per_rank = rank_metrics(tr.events).set_index("rank")
    for r, g in enumerate(global_ranks):  # each rank's bubble is its own file's
        theirs = independent_bubble(d / f"rank{g}_trace.json")
        assert per_rank.loc[r, "bubble_ratio"] == pytest.approx(theirs, abs=0.03), (r, g)


def test_without_process_groups_the_stages_tell_the_pipelines_apart(job, tmp_path):
    bare = _without_groups(job / "ZBVZeroBubble", tmp_path / "bare")
    with_groups = convert([job / "ZBVZeroBubble"])
    tr = convert([bare])
    assert tr.meta["global_ranks"] == [0, 2] and tr.meta["schedule"] == "zbv"
    assert "(the stages each rank ran)" in tr.meta["note"]
    cols = ["rank", "stage", "microbatch", "kind", "start_ns"]
    assert (
        tr.events[cols]
        .reset_index(drop=True)
        .equals(with_groups.events[cols].reset_index(drop=True))
    )


def test_a_job_whose_ranks_name_no_actions_is_split_by_its_groups(job):
    tr = convert([job / "1F1B"])
    assert tr.meta["global_ranks"] == [0, 2] and tr.meta["schedule"] == "1f1b"
    assert "follow 1f1b at M=4" in tr.meta["note"]


def test_analyze_and_predict_on_one_pipeline_of_the_job(job, capsys):
    # the counterpart's trace is read at the same pipeline
    assert main(["analyze", str(job / "ZBVZeroBubble"), "--pipeline", "1", "--predict",
                 f"1f1b={job / '1F1B'}"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "schedule zbv, ranks 2, stages 4" in out and "pipeline 1, global ranks 1, 3" in out
    own = convert([job / "1F1B"], pipeline=1).events
    profiled = own[(own["kind"] == "other") & (own["name"] == "STEP")]
    row = next(ln for ln in out.splitlines() if ln.split()[:1] == ["1f1b"])
    longest = (profiled["end_ns"] - profiled["start_ns"]).max() / 1e6
    assert float(row.split()[4]) == pytest.approx(longest, abs=0.002), row
    assert main(["analyze", str(job / "ZBVZeroBubble"), "--pipeline", "5"]) == 2
    err = capsys.readouterr().err
    assert "--pipeline 5: the traces hold 2 pipelines" in err and "Traceback" not in err


def test_a_pipeline_across_hosts_is_put_on_one_clock(job, tmp_path):
    """Global ranks 2 and 3 on a host whose clock reads ahead, 5 ms beyond what the messages
    could hide (the least time a message took from rank 1 to rank 0, which a busy host
    stretches): the second rank of each pipeline. Their times are put back within what the
    messages allow, and nothing a rank measured on its own clock changes."""
    from vpipe.trace.clock_offsets import message_delays

    d = job / "ZBVZeroBubble"
    one = convert([d])
    assert "clock_offsets_ns" not in one.meta  # one host: left as it was
    bound = message_delays(one.events).groupby(["src", "dst"])["d_ns"].min()
    half = (bound[(0, 1)] + bound[(1, 0)]) / 2  # the true offset lies within it
    ahead = int(bound[(1, 0)]) + 5_000_000
    (tmp_path / "hosts").mkdir()
    for f in d.glob("*.json"):
        doc = json.loads(f.read_text())
        if doc["distributedInfo"]["rank"] >= 2:
            doc["baseTimeNanoseconds"] += ahead
        (tmp_path / "hosts" / f.name).write_text(json.dumps(doc))
    two = convert([tmp_path / "hosts"])
    assert abs(two.meta["clock_offsets_ns"]["1"] - ahead) <= half
    assert "the ranks' clocks differ" in two.meta["note"]
    cols = ["bubble_ratio", "comm_wait_s", "window_s"]
    assert rank_metrics(one.events)[cols].equals(rank_metrics(two.events)[cols])
