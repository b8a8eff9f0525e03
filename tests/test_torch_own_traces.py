"""Traces written by torch.distributed.pipelining's own schedule classes, recorded here as a
torch user records them (bench.torch_traces: torch.profiler with a wait/warmup/active schedule,
default operator recording, ``rank<N>_trace.json``, no vpipe metadata), read truthfully:

- each rank's bubble equals, within 0.03, an independent reading taken from the JSON here: per
  action span (``PP:`` or GPipe's ``Forward i`` / ``Backward i``), the stretch from its first
  operator to the end of its last (communication calls left out); for a rank naming no actions
  (Schedule1F1B), the runs of top-level operators between communication calls;
- the ranks next to the slow stage wait (over 5% of their step);
- ranks, microbatches and the schedule come from the trace, and ``analyze --predict`` works.

One launch per rank count: P=2 balanced and with stage 1 four times slower, P=4 slow.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.torch_traces import CLASSES, record
from vpipe.errors import TraceError
from vpipe.metrics.per_run import rank_metrics
from vpipe.trace.kineto import convert

SLOW = (1, 4)  # stage 1 runs 4 times the blocks
M_OF = {2: 4, 4: 8}  # DualPipeV needs as many microbatches as stages
COMM = re.compile(r"(c10d::|gloo:|nccl|record_param_comms)", re.IGNORECASE)
ACTION = re.compile(r"PP:(\d+[FIBW]\d+|\(.*\)OVERLAP_F_B)|(Forward|Backward) \d+")
NOT_A_CATALOGUE_PROGRAM = {"LoopedBFS"}  # torch runs its backwards in reverse microbatch order


@pytest.fixture(scope="module")
def p2(tmp_path_factory):
    return record(tmp_path_factory.mktemp("p2"), 2, microbatches=M_OF[2], blocks=1, slow=SLOW,
                  both=True, wait=0)  # fmt: skip


@pytest.fixture(scope="module")
def p4(tmp_path_factory):
    return record(tmp_path_factory.mktemp("p4"), 4, microbatches=M_OF[4], blocks=1, slow=SLOW,
                  wait=0)  # fmt: skip


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach, start = 0.0, None, None
    for s, e in sorted(intervals):
        if reach is None or s > reach:
            total += 0 if reach is None else reach - start
            start, reach = s, e
        else:
            reach = max(reach, e)
    return total + (0 if reach is None else reach - start)


def independent_bubble(path: Path) -> float:
    """1 - busy / step of one rank's profiled step, read from the JSON directly."""
    events = json.loads(path.read_text())["traceEvents"]
    step = next(e for e in events if e.get("name", "").startswith("ProfilerStep#"))
    s0, s1 = step["ts"], step["ts"] + step["dur"]
    ops = sorted(
        (e["ts"], e["ts"] + e["dur"], bool(COMM.match(e["name"])))
        for e in events
        if e.get("cat") == "cpu_op" and s0 <= e["ts"] < s1
    )
    compute = [(s, e) for s, e, comm in ops if not comm]
    spans = [e for e in events if e.get("cat") == "user_annotation" and ACTION.fullmatch(e["name"])]
    busy = []
    if spans:
        for sp in spans:
            a, z = sp["ts"], sp["ts"] + sp["dur"]
            inside = [(s, e) for s, e in compute if a <= s < z]
            if inside:
                busy.append((inside[0][0], min(z, max(e for _, e in inside))))
    else:  # runs of top-level operators, cut at communication calls
        reach, run = -1.0, None
        for s, e, comm in ops:
            if s < reach:
                reach = max(reach, e)
                continue
            reach = e
            if comm:
                run = busy.append(run) if run else None
            else:
                run = (run[0], e) if run else (s, e)
        if run:
            busy.append(run)
    return 1 - _union(busy) / (s1 - s0)


def _check_run(d: Path, n_ranks: int, slow: bool) -> None:
    name = d.name.removesuffix("-slow")
    tr = convert([d])
    per_rank = rank_metrics(tr.events).set_index("rank")
    assert sorted(per_rank.index) == list(range(n_ranks)), d.name
    for r in range(n_ranks):
        ours = per_rank.loc[r, "bubble_ratio"]
        theirs = independent_bubble(d / f"rank{r}_trace.json")
        assert ours == pytest.approx(theirs, abs=0.03), (d.name, r)
    assert tr.meta["ranks"] == n_ranks
    if name == "1F1B":  # no action spans: what is missing is said
        assert "no actions" in tr.meta["note"] and "microbatches" not in tr.meta
    else:
        assert tr.meta["microbatches"] == M_OF[n_ranks]
        n_stages = n_ranks if CLASSES[name] == "single" else 2 * n_ranks
        assert tr.meta["stages"] == n_stages
        if name in NOT_A_CATALOGUE_PROGRAM:
            assert tr.meta["schedule"] == "custom" and tr.meta["program"]
        else:
            assert tr.meta["torch_class"] == f"Schedule{name}", d.name
    if slow:  # its neighbours wait for the slow stage's rank
        slow_rank = SLOW[0]
        for r in (slow_rank - 1, slow_rank + 1):
            if r < n_ranks:
                row = per_rank.loc[r]
                # (not also "idler than the slow rank": on a shared 2-core host the ranks take
                # turns on the cores, and a rank descheduled mid-action looks busy)
                assert row["comm_wait_s"] > 0.05 * row["window_s"], (d.name, r)


@pytest.mark.parametrize("name", list(CLASSES))
def test_p2_balanced_and_slow(p2, name):
    _check_run(p2 / name, 2, slow=False)
    _check_run(p2 / f"{name}-slow", 2, slow=True)


@pytest.mark.parametrize("name", list(CLASSES))
def test_p4_slow(p4, name):
    _check_run(p4 / f"{name}-slow", 4, slow=True)


def test_predict_without_vpipe_metadata(p2):
    from vpipe.commands.trace import analyze

    found = analyze(str(p2 / "ZBVZeroBubble"), run=None, predict=["dualpipev", "1f1b"])
    table = found["predictions"].set_index("schedule")
    assert found["run"]["schedule"] == "zbv" and found["run"]["microbatches"] == M_OF[2]
    assert (table["predicted_step_ms"] > 0).all() and len(table) == 3
    with pytest.raises(TraceError, match="per-action costs.*name no actions"):
        analyze(str(p2 / "1F1B"), run=None, predict=["zbv"], microbatches=M_OF[2])


def test_store_report_and_csv_without_vpipe_metadata(p2, tmp_path):
    from vpipe.cli import main
    from vpipe.ir import Schedule

    store = str(tmp_path / "store")
    for name in ("ZBVZeroBubble", "DualPipeV"):
        assert main(["trace", str(p2 / name), "--store", store]) == 0
    out = tmp_path / "report.html"
    assert main(["report", store, "-o", str(out)]) == 0  # no memory samples: still a report
    md = out.with_suffix(".md").read_text()
    assert "| torch | zbv |" in md and "| torch | dualpipev |" in md
    csv = tmp_path / "looped.csv"
    assert main(["trace", str(p2 / "LoopedBFS"), "--csv", str(csv)]) == 0
    program = Schedule.from_csv(csv)
    assert program.n_ranks == 2 and program.n_microbatches == M_OF[2]
    assert [str(a) for a in program.actions[0][-2:]] == ["0B1", "0B0"]  # torch's order
