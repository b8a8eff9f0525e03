"""Ranks whose clocks disagree (a job across hosts): the messages' bounds find the offset, the
tables are put on one clock, and traces from one host are left exactly as they are
(vpipe.trace.clock_offsets). The same on a recorded torch job: tests/test_pipelines.py."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_trace_kineto import META, PROGRAMS

from vpipe.metrics.per_run import rank_metrics
from vpipe.trace.clock_offsets import TOLERANCE_NS, message_delays, rank_offsets
from vpipe.trace.kineto import convert
from vpipe.trace.synth import write_synthetic_run

MS = 1_000_000


def _delays(*rows: tuple[int, int, float]) -> pd.DataFrame:
    return pd.DataFrame(
        {"src": [r[0] for r in rows], "dst": [r[1] for r in rows],
         "d_ns": [int(r[2] * MS) for r in rows]}
    )  # fmt: skip


def test_consistent_clocks_give_no_offsets():
    assert rank_offsets(_delays((0, 1, 0.4), (0, 1, 0.9), (1, 0, 0.2))) == {}
    assert rank_offsets(_delays()) == {}
    # inconsistent by less than the tolerance: left
    assert rank_offsets(_delays((0, 1, 0.4), (1, 0, -TOLERANCE_NS / MS / 2))) == {}
    # consumed "before sent" both ways: no offset explains it (sends not marked), so none
    assert rank_offsets(_delays((0, 1, -0.3), (1, 0, -0.3))) == {}


def test_an_offset_is_the_middle_of_what_the_messages_allow():
    # rank 1's clock 5 ms ahead; messages take at least 1.0 ms one way and 0.2 ms the other
    got = rank_offsets(_delays((0, 1, 5 + 1.0), (0, 1, 5 + 3.0), (1, 0, -5 + 0.2)))
    assert got == {1: int(5.4 * MS)}  # within half the interval's width (0.6 ms) of 5 ms
    # three ranks in a chain, 1 behind by 2 ms, 2 ahead of 1 by 7 ms
    chain = rank_offsets(_delays((0, 1, -2 + 0.5), (1, 0, 2 + 0.5),
                                 (1, 2, 7 + 0.5), (2, 1, -7 + 0.5)))  # fmt: skip
    assert chain == {1: -2 * MS, 2: 5 * MS}
    # messages one way only: as little shift as makes them causal
    assert rank_offsets(_delays((1, 0, -3.0))) == {1: 3 * MS}


def test_synthetic_trace_from_one_clock_is_unchanged(tmp_path):
    write_synthetic_run(tmp_path, PROGRAMS, steps=[3, 4], meta=META)
    tr = convert([tmp_path])
    assert "clock_offsets_ns" not in tr.meta and "clock" not in str(tr.meta.get("note"))


@pytest.mark.parametrize("shift_ms", [5.0, -3.0])
def test_a_rank_on_another_clock_is_put_back(tmp_path, shift_ms):
    write_synthetic_run(tmp_path / "one", PROGRAMS, steps=[3, 4], meta=META)
    (tmp_path / "two").mkdir()
    for f in (tmp_path / "one").iterdir():
        doc = json.loads(f.read_text())
        if doc["vpipe"]["rank"] == 1:
            doc["baseTimeNanoseconds"] += int(shift_ms * MS)
        (tmp_path / "two" / f.name).write_text(json.dumps(doc))
    one, two = convert([tmp_path / "one"]), convert([tmp_path / "two"])
    # the middle of the interval the messages allow: the shift, and what the one-clock trace's
    # bounds leave (laid out on a made-up clock, it breaks causality by microseconds)
    bound = message_delays(one.events).groupby(["src", "dst"])["d_ns"].min()
    middle = shift_ms * MS + (bound[(0, 1)] - bound[(1, 0)]) / 2
    assert two.meta["clock_offsets_ns"] == {"1": round(middle)}
    assert abs(middle - shift_ms * MS) < TOLERANCE_NS
    assert "the ranks' clocks differ" in two.meta["note"]
    assert (message_delays(two.events)["d_ns"] >= -TOLERANCE_NS).all()  # causal again
    # per-rank figures never depended on it
    cols = ["bubble_ratio", "comm_wait_s", "window_s"]
    pd.testing.assert_frame_equal(rank_metrics(one.events)[cols], rank_metrics(two.events)[cols])
