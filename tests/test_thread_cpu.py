"""The communication threads' CPU time (vpipe.trace.thread_cpu) and its cost per posted message
in predictions (vpipe.predict.calibrate.with_comm_threads)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from vpipe.ir.lowering import lower
from vpipe.predict.calibrate import (
    Calibration,
    anchor,
    comm_thread_cpu_s,
    predict,
    with_comm_threads,
)
from vpipe.schedules import make_schedule
from vpipe.sim.posts import posted_operations
from vpipe.sweep.write import comm_thread_sentence, split_sentence
from vpipe.trace import thread_cpu
from vpipe.trace.thread_cpu import comm_thread_ns, cores_shared, parse_schedstat


def _task(root, tid: int, name: str, ns: int) -> None:
    d = root / str(tid)
    d.mkdir()
    (d / "comm").write_text(name + "\n")
    (d / "schedstat").write_text(f"{ns} 1234 56\n")


def test_schedstat_gives_the_nanoseconds_on_cpu():
    assert parse_schedstat("331107 2482396 2\n") == 331107


def test_comm_threads_are_found_by_name_and_the_poster_by_its_id(tmp_path):
    _task(tmp_path, 100, "python", 9_000_000)  # the compute thread
    _task(tmp_path, 101, "gloo_tcp_loop", 5_000)
    _task(tmp_path, 102, "python", 7_000)  # the poster: a plain name, known by its id
    _task(tmp_path, 103, "pt_gloo_runloop", 300)
    (tmp_path / "104").mkdir()  # a thread that ended while the directory was read
    assert comm_thread_ns((102,), str(tmp_path)) == 12_300
    assert comm_thread_ns((), str(tmp_path)) == 5_300
    assert comm_thread_ns((), str(tmp_path / "absent")) is None


def test_a_busy_thread_of_this_process_is_counted_by_its_id():
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        before = comm_thread_ns((t.native_id,))
        if before is None:
            pytest.skip("no /proc/self/task here")
        time.sleep(0.2)
        after = comm_thread_ns((t.native_id,))
    finally:
        stop.set()
        t.join()
    assert after - before > 10_000_000  # 10 ms of a spinning thread's 200


def test_cores_are_shared_when_compute_threads_take_every_core(monkeypatch):
    monkeypatch.setattr(thread_cpu.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cores_shared(2) and cores_shared(4)
    assert not cores_shared(1)


def test_posted_operations_count_one_per_message_and_one_per_bundle():
    s = make_schedule("1f1b", 2, 4)
    comm = sum(1 for _, _, a in lower(s).iter_actions() if a.is_comm)
    assert posted_operations(s) == comm == 16  # each rank: 4 activations and 4 gradients
    assert posted_operations(lower(s)) == 16  # a lowered schedule counts the same
    # interleaved-1f1b at P=2 crosses ranks at every stage boundary: more messages
    assert posted_operations(make_schedule("interleaved-1f1b", 2, 4)) > 16


def _calibration(n_stages: int) -> Calibration:
    ones = np.full(n_stages, 1000.0)
    return Calibration(ones, ones, ones, post=10.0, gap=0.0, comm_latency=0.0, w_share=None)


def test_the_threads_cost_per_posted_operation_is_charged_with_posting():
    s = make_schedule("1f1b", 2, 4)
    cal = with_comm_threads(_calibration(2), s, 0.008)  # 8 ms per step over 16 posts
    assert cal.comm_threads == pytest.approx(500.0)
    assert cal.cost_model(s).post == pytest.approx(510.0)
    # a schedule that posts more pays more: interleaved-1f1b grows by more than 1f1b
    il = make_schedule("interleaved-1f1b", 2, 4)
    grow = {
        x.name: predict(cal, x, 4).makespan - predict(replace(cal, comm_threads=0.0), x, 4).makespan
        for x in (s, il)
    }
    assert grow["1f1b"] > 0 and grow["interleaved-1f1b"] > grow["1f1b"]
    assert with_comm_threads(_calibration(2), s, None).comm_threads == 0.0
    # the anchor charges them first, then scales compute to the timed median with them
    anchored = anchor(_calibration(2), s, 0.02, 4, comm_thread_cpu_s=0.008)
    assert anchored.comm_threads == pytest.approx(500.0)
    assert predict(anchored, s, 4).makespan == pytest.approx(20_000.0, rel=1e-3)


def test_comm_thread_cpu_s_reads_rows_and_metadata_and_refuses_what_is_not_a_figure():
    key = "comm_thread_cpu_s"
    assert comm_thread_cpu_s({key: 0.0125}) == 0.0125
    assert comm_thread_cpu_s(pd.Series({key: 0.003})) == 0.003
    assert comm_thread_cpu_s(next(pd.DataFrame({key: [0.004]}).itertuples())) == 0.004
    for missing in ({}, {key: None}, {key: pd.NA}, {key: -1.0}, {key: "x"}):
        assert comm_thread_cpu_s(missing) is None


def test_the_report_says_what_the_threads_took_where_measured():
    runs = pd.DataFrame(
        {"impl": ["vpipe", "vpipe", "torch"], "microbatches": [4, 4, 4], "ranks": [2, 2, 2],
         "step_time_s": [0.25, 0.2, 0.3], "comm_thread_cpu_s": [0.010, 0.004, None]}
    )  # fmt: skip
    said = comm_thread_sentence(runs, "vpipe", 4)
    assert "4.0-10.0 ms of CPU per step" in said and "(1.0-2.0% of the ranks' time)" in said
    assert comm_thread_sentence(runs, "torch", 4) == ""
    assert comm_thread_sentence(runs.drop(columns="comm_thread_cpu_s"), "vpipe", 4) == ""


def test_the_report_says_what_the_split_backward_cost_where_probed():
    runs = pd.DataFrame(
        {"impl": ["vpipe", "vpipe", "torch"], "microbatches": [4, 4, 4],
         "split_backward_ratio": [1.08, 1.21, None]}
    )  # fmt: skip
    assert "cost 1.08-1.21x a fused B" in split_sentence(runs, "vpipe", 4)
    assert split_sentence(runs, "torch", 4) == ""
    assert split_sentence(runs.drop(columns="split_backward_ratio"), "vpipe", 4) == ""
