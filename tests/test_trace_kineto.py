"""Kineto JSON -> event/memory tables, on synthetic traces shaped like the runtime's."""

import json
from pathlib import Path

import numpy as np
import orjson
import pytest

from vpipe.errors import TraceError
from vpipe.events import EVENT_COLUMNS, MEMORY_COLUMNS
from vpipe.ir import actions_from_strings
from vpipe.metrics.per_run import step_breakdown
from vpipe.trace import kineto_json
from vpipe.trace.kineto import convert
from vpipe.trace.synth import synthetic_trace, write_synthetic_run

# 1F1B at P=2, M=3, lowered by hand (rank 0: stage 0, rank 1: stage 1).
PROGRAMS = actions_from_strings(
    [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0F2", "0SEND_F2",
         "0RECV_B1", "0B1", "0RECV_B2", "0B2"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1",
         "1RECV_F2", "1F2", "1B2", "1SEND_B2"],
    ]
)  # fmt: skip
META = {"run_id": "syn", "schedule": "1f1b", "impl": "vpipe", "ranks": 2, "microbatches": 3}


def test_one_compute_row_per_action_per_step(tmp_path):
    write_synthetic_run(tmp_path, PROGRAMS, steps=[3, 4], meta=META)
    tr = convert([tmp_path])
    ev = tr.events
    assert list(ev.columns) == list(EVENT_COLUMNS)
    assert ev.dtypes.astype(str).to_dict() == EVENT_COLUMNS
    assert tr.meta["run_id"] == "syn" and set(ev["run_id"]) == {"syn"}
    assert set(ev["impl"]) == {"vpipe"} and set(ev["source"]) == {"measured"}
    for rank, program in enumerate(PROGRAMS):
        for step in (3, 4):
            got = ev[(ev["rank"] == rank) & (ev["step"] == step)]
            rows = [
                tuple(x) for x in got[["kind", "stage", "microbatch", "name"]].astype(str).values
            ]
            want = [(a.kind.value, str(a.stage), str(a.microbatch), str(a)) for a in program]
            assert [r for r in rows if r[0] not in ("WAIT", "other")] == want
            waits = [r for r in rows if r[0] == "WAIT"]
            recvs = [a for a in program if a.kind.value.startswith("RECV")]
            assert waits == [("WAIT", str(a.stage), str(a.microbatch), f"WAIT:{a}") for a in recvs]
            assert rows.count(("other", "-1", "-1", "STEP")) == 1
            # compute rows start after the waits nested in their spans
            comp = got[got["kind"].isin(["F", "B"])]
            for _, w in got[got["kind"] == "WAIT"].iterrows():
                assert not (
                    (comp["start_ns"] < w["end_ns"]) & (comp["end_ns"] > w["start_ns"])
                ).any()
    assert (ev["end_ns"] >= ev["start_ns"]).all()
    # memory: one [memory] sample per op (2 per compute or comm action), all inside steps 3/4
    mem = tr.memory
    assert list(mem.columns) == list(MEMORY_COLUMNS)
    assert set(mem["what"]) == {"cpu_allocated"} and set(mem["step"]) == {3, 4}
    assert len(mem) == 2 * 2 * sum(len(p) for p in PROGRAMS)


def test_gpu_annotation_copies_are_not_counted_twice(tmp_path):
    """On CUDA, Kineto repeats record_function spans on a GPU stream (``gpu_user_annotation``):
    they time the rows of the CPU-side spans and never make rows of their own (compute rows in
    device order, communication rows in host order: each in program order)."""
    write_synthetic_run(tmp_path, PROGRAMS, steps=[3, 4], meta=META, gpu=True)
    doc = orjson.loads((tmp_path / "rank0.pt.trace.json").read_bytes())
    cats = {e["cat"] for e in doc["traceEvents"] if e["name"] in ("PP:0F0", "PP:STEP:3")}
    assert cats == {"user_annotation", "gpu_user_annotation"}
    ev = convert([tmp_path]).events
    for rank, program in enumerate(PROGRAMS):
        for step in (3, 4):
            got = ev[(ev["rank"] == rank) & (ev["step"] == step)]
            for clock, keep in (("device", lambda a: a.is_compute), ("host", lambda a: a.is_comm)):
                rows = got[(got["clock"] == clock) & ~got["kind"].isin(["WAIT", "other"])]
                assert list(rows["name"]) == [str(a) for a in program if keep(a)]
            assert (got["name"] == "STEP").sum() == 1
    assert set(ev["step"]) == {3, 4}


def test_overlap_action_rows_and_nested_part_spans(tmp_path):
    programs = actions_from_strings([["0F0", "(0F1;1B0)OVERLAP_F_B", "1B1"]])
    doc = synthetic_trace(programs, 0, meta={"run_id": "ov"})
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "rank0.json").write_bytes(orjson.dumps(doc))
    ev = convert([tmp_path / "a"]).events
    compute = ev[ev["kind"].isin(["F", "B"])]
    assert list(zip(compute["kind"], compute["stage"], compute["microbatch"], strict=True)) == [
        ("F", 0, 0), ("F", 0, 1), ("B", 1, 0), ("B", 1, 1)
    ]  # fmt: skip
    parts = compute[compute["name"] == "(0F1;1B0)OVERLAP_F_B"]
    assert len(parts) == 2 and parts["start_ns"].nunique() == 1
    # when the runtime also records each part's own span, those replace the expansion
    ov = next(e for e in doc["traceEvents"] if e["name"] == "PP:(0F1;1B0)OVERLAP_F_B")
    half = ov["dur"] / 2
    for i, name in enumerate(["PP:0F1", "PP:1B0"]):
        doc["traceEvents"].append({**ov, "name": name, "ts": ov["ts"] + i * half, "dur": half})
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "rank0.json").write_bytes(orjson.dumps(doc))
    ev2 = convert([tmp_path / "b"]).events
    compute2 = ev2[ev2["kind"].isin(["F", "B"])]
    assert len(compute2) == 4 and set(compute2["name"]) == {"0F0", "0F1", "1B0", "1B1"}


def test_overlap_parts_are_split_at_the_waits_nested_in_the_compound(tmp_path):
    """The runtime runs an overlap's parts one after another, each waiting for its input just
    before it runs, inside the one compound span: each part's row is its own stretch between
    those waits, so the time the first part computes is not lost to "other"."""
    programs = actions_from_strings([["0F0", "(0F1;1B0)OVERLAP_F_B", "1B1"]])
    doc = synthetic_trace(programs, 0, meta={"run_id": "ov"})
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "rank0.json").write_bytes(orjson.dumps(doc))
    without_waits = step_breakdown(convert([tmp_path / "plain"]).events).iloc[0]
    ov = next(e for e in doc["traceEvents"] if e["name"] == "PP:(0F1;1B0)OVERLAP_F_B")
    t, d = ov["ts"], ov["dur"]
    for name, at, dur in (("PP:WAIT:0RECV_F1", 0.0, 1.0), ("PP:WAIT:1RECV_B0", d / 2, 1.0)):
        doc["traceEvents"].append({**ov, "name": name, "ts": t + at, "dur": dur})
    (tmp_path / "waits").mkdir()
    (tmp_path / "waits" / "rank0.json").write_bytes(orjson.dumps(doc))
    ev = convert([tmp_path / "waits"]).events
    parts = ev[ev["name"] == "(0F1;1B0)OVERLAP_F_B"].set_index("kind")
    base = ev.loc[ev["name"] == "WAIT:0RECV_F1", "start_ns"].iloc[0]
    assert (parts.loc["F", "start_ns"] - base, parts.loc["F", "end_ns"] - base) == (
        1000, round(d / 2 * 1000)
    )  # fmt: skip
    assert parts.loc["B", "start_ns"] - base == round((d / 2 + 1) * 1000)
    assert parts.loc["B", "end_ns"] - base == round(d * 1000)
    b = step_breakdown(ev).iloc[0]
    # the compound is computing or waiting throughout: nothing of it lands in "other" (the
    # breakdown's float seconds of epoch-scale nanoseconds resolve to about 0.25 us)
    tol = 0.3e-6
    assert b["other"] == pytest.approx(without_waits["other"], abs=tol)
    assert b["wait"] == pytest.approx(2e-6, abs=tol)
    assert b["compute"] == pytest.approx(without_waits["compute"] - 2e-6, abs=tol)


def test_torch_style_trace_without_vpipe_steps(tmp_path):
    """No PP:STEP spans and no metadata: steps from ProfilerStep#N, impl torch, rank by name."""
    doc = synthetic_trace(PROGRAMS, 1, steps=[5])
    doc.pop("vpipe")
    doc.pop("distributedInfo")
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not e["name"].startswith("PP:STEP")]
    path = tmp_path / "trainer_rank1.json"
    path.write_text(json.dumps(doc))
    tr = convert([path])
    assert tr.meta["impl"] == "torch" and tr.meta["schedule"] == "unknown"
    assert set(tr.events["rank"]) == {1} and set(tr.events["step"]) == {5}
    assert (tr.events["kind"] == "F").sum() == 3


@pytest.mark.parametrize("damage", ["truncate", "garbage", "not_a_trace", "bad_event"])
def test_damaged_trace_is_a_trace_error_naming_the_file(tmp_path, damage):
    path = write_synthetic_run(tmp_path, PROGRAMS, meta=META)[0]
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        mid = len(raw) // 2
        path.write_bytes(raw[:mid] + b"\x00}{ garbage" + raw[mid:])
    elif damage == "not_a_trace":
        path.write_bytes(b'{"hello": 1}')
    else:
        doc = orjson.loads(raw)
        next(e for e in doc["traceEvents"] if e["name"] == "PP:0F1").pop("ts")
        path.write_bytes(orjson.dumps(doc))
    with pytest.raises(TraceError, match=r"rank0\.pt\.trace\.json") as err:
        convert([path])
    if damage == "truncate":
        assert "truncated" in str(err.value) and "line" in str(err.value)
    if damage == "bad_event":
        assert "PP:0F1" in str(err.value)


def test_fast_path_equals_full_parse_and_falls_back(tmp_path):
    path = write_synthetic_run(tmp_path, PROGRAMS, steps=[0, 1], meta=META)[1]
    raw = path.read_bytes()
    fast, full = kineto_json._fast(raw, path), kineto_json._full(raw, path)
    assert fast is not None
    assert fast.spans == full.spans and fast.header == full.header
    assert fast.n_events == full.n_events
    for k in full.memory:
        np.testing.assert_array_equal(fast.memory[k], full.memory[k])
    # a layout the fast path does not slice (args before name) still converts, via full parse
    doc = orjson.loads(raw)
    doc["traceEvents"] = [{"args": e.pop("args", {}), **e} for e in doc["traceEvents"]]
    raw2 = orjson.dumps(doc)
    assert kineto_json._fast(raw2, path) is None
    assert kineto_json.read_trace(path).spans == full.spans


def test_fast_path_memory_events_in_any_key_order(tmp_path):
    path = write_synthetic_run(tmp_path, PROGRAMS, meta=META)[0]
    doc = orjson.loads(path.read_bytes())
    mem = [e for e in doc["traceEvents"] if e["name"] == "[memory]"]
    for e in mem:
        e["args"] = dict(reversed(e["args"].items()))
    raw = orjson.dumps({k: doc[k] for k in reversed(doc)}, option=orjson.OPT_INDENT_2)
    fast, full = kineto_json._fast(raw, path), kineto_json._full(raw, path)
    assert fast is not None and len(full.memory["ts"]) == len(mem)
    assert fast.spans == full.spans and fast.n_events == full.n_events
    for k in full.memory:
        np.testing.assert_array_equal(fast.memory[k], full.memory[k])
    # a [memory] event lacking a field, or a span named like one: the full parse decides
    del mem[0]["args"]["Device Type"]
    assert kineto_json._fast(orjson.dumps(doc), path) is None
    mem[0]["args"]["Device Type"] = 0
    doc["traceEvents"][0]["name"] = "[memory] span"
    assert kineto_json._fast(orjson.dumps(doc), path) is None
    # without [memory] events the fast path equals the full parse too
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not e["name"].startswith("[memory]")]
    raw = orjson.dumps(doc)
    fast, full = kineto_json._fast(raw, path), kineto_json._full(raw, path)
    assert fast is not None and fast.spans == full.spans and len(fast.memory["ts"]) == 0


def test_rank_conflicts_and_missing_files(tmp_path):
    write_synthetic_run(tmp_path / "a", PROGRAMS, meta=META)
    write_synthetic_run(tmp_path / "b", PROGRAMS, meta=META)
    with pytest.raises(TraceError, match="rank 0 also comes from"):
        convert([tmp_path / "a", tmp_path / "b" / "rank0.pt.trace.json"])
    with pytest.raises(TraceError, match="no such trace file"):
        convert([tmp_path / "nope.json"])
    with pytest.raises(TraceError, match="no trace files"):
        (tmp_path / "empty").mkdir()
        convert([tmp_path / "empty"])
    # torchtitan's layout: one subdirectory per profiled iteration
    for it in (10, 20):
        write_synthetic_run(tmp_path / "profile_traces" / f"iteration_{it}", PROGRAMS, meta=META)
    with pytest.raises(TraceError, match="subdirectories iteration_10, iteration_20 hold some"):
        convert([tmp_path / "profile_traces"])
    assert Path(tmp_path / "a" / "rank1.pt.trace.json").exists()


def test_measured_and_simulated_tables_share_one_schema(tmp_path):
    from vpipe.schedules import make_schedule
    from vpipe.sim import simulate

    write_synthetic_run(tmp_path, PROGRAMS, meta=META)
    measured = convert([tmp_path]).events
    sched = make_schedule("1f1b", 2, 3)
    simulated = simulate(sched).to_events("sim", sched)
    assert list(measured.columns) == list(simulated.columns) == list(EVENT_COLUMNS)
    assert measured.dtypes.astype(str).to_dict() == simulated.dtypes.astype(str).to_dict()
    assert set(simulated["source"]) == {"simulated"} and set(measured["source"]) == {"measured"}
    # same semantics: every compute action of the program appears once in both
    key = ["rank", "stage", "microbatch", "kind"]
    comp = lambda df: sorted(map(tuple, df[df["kind"].isin(["F", "B"])][key].astype(str).values))  # noqa: E731
    assert comp(measured) == comp(simulated)


def test_cuda_memory_rows_are_the_runs_own_devices(tmp_path):
    """A process can touch several devices: only the run's own device's allocator events (its
    index in the metadata) become memory rows; CPU ones stay."""
    doc = synthetic_trace(PROGRAMS, 0, steps=[0], meta={**META, "device_index": 1})
    t0 = next(e["ts"] for e in doc["traceEvents"] if e["name"] == "PP:STEP:0") + 1
    for i, device in enumerate((0, 1, 1)):
        doc["traceEvents"].append(
            {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1000,
             "tid": 1000, "ts": t0 + i, "args": {"Total Reserved": 8 << 20, "Bytes": 1,
             "Total Allocated": (device + 1) << 20, "Device Id": device, "Device Type": 1,
             "Addr": i}}
        )  # fmt: skip
    (tmp_path / "rank0.json").write_bytes(orjson.dumps(doc))
    mem = convert([tmp_path / "rank0.json"]).memory
    cuda = mem[mem["what"] == "cuda_allocated"]
    assert len(cuda) == 2 and set(cuda["bytes"]) == {2 << 20}
    assert (mem["what"] == "cpu_allocated").sum() > 0
