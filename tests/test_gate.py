"""The round gate between a paced side and its ranks (vpipe.sweep.gate), without ranks."""

from __future__ import annotations

import threading

import pytest

from vpipe.sweep.gate import Gate, GateError, RankGate


def test_every_rank_waits_for_each_round_and_rank_0_answers(tmp_path):
    gate = Gate(tmp_path, 2)
    seen: dict[int, list[bool]] = {0: [], 1: []}

    def rank(r: int) -> None:
        end = RankGate(tmp_path, r)
        end.ready()
        while True:
            more = end.next_round()
            seen[r].append(more)
            if not more:
                break
            end.done()
        end.close()

    ranks = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in ranks:
        t.start()
    gate.wait()  # ready: only rank 0 says so
    gate.round()
    gate.round()
    gate.stop()
    for t in ranks:
        t.join(10)
    gate.close()
    assert seen == {0: [True, True, False], 1: [True, True, False]}


def test_a_failed_launch_wakes_the_wait_with_its_reason(tmp_path):
    gate = Gate(tmp_path, 1)
    gate.fail("rank 1 failed: boom")
    with pytest.raises(GateError, match="^rank 1 failed: boom$"):
        gate.wait()
    gate.close()
