"""CUDA traces of torch.distributed.pipelining on NCCL (synthetic, laid out as Kineto writes
them: vpipe.trace.synth_torch_cuda) read truthfully: torch marks no waits, so each receiving
action's wait is found on the device from its receive's NCCL kernel
(vpipe.trace.device_waits); Schedule1F1B, which names no actions, gets runs of kernels
(vpipe.trace.device_runs). Each rank's busy time, step and waits equal what the layout says,
to 2 us; the ranks next to a slow stage wait; the metadata comes from the trace."""

from __future__ import annotations

import pytest

from vpipe.ir import parse_action
from vpipe.metrics.per_run import rank_metrics
from vpipe.schedules import make_schedule
from vpipe.trace.kineto import convert
from vpipe.trace.synth_torch_cuda import write_torch_cuda_run

TOL_US = 2.0
SLOW_US = 60.0  # a slow stage's kernels (the others' are 20 us)
# (catalogue schedule, the spans torch writes, the slow rank's stages)
CASES = {
    "zbv": ("zbv", "actions", ()),
    "zbv-slow": ("zbv", "actions", (1, 2)),  # rank 1 holds stages 1 and 2
    "interleaved-slow": ("interleaved-1f1b", "actions", (1, 3)),
    "gpipe": ("gpipe", "gpipe", ()),
    "gpipe-slow": ("gpipe", "gpipe", (1,)),
    "1f1b": ("1f1b", "none", ()),
    "1f1b-slow": ("1f1b", "none", (1,)),
}
NAMED = [c for c in CASES if CASES[c][1] != "none"]


def _read(tmp_path, case: str):
    name, spans, slow = CASES[case]
    truth = write_torch_cuda_run(
        tmp_path, make_schedule(name, 2, 4), spans=spans, kernel_us=dict.fromkeys(slow, SLOW_US)
    )
    return convert([tmp_path]), truth


def _direction(action: str) -> tuple[int, int, str]:
    a = parse_action(action)
    return a.stage, a.microbatch, "F" if a.kind.value == "F" else "B"


@pytest.mark.parametrize("case", list(CASES))
def test_busy_step_and_waits_are_the_layouts(tmp_path, case):
    trace, truth = _read(tmp_path, case)
    m = rank_metrics(trace.events).set_index("rank")
    ev = trace.events
    for r, t in enumerate(truth):
        assert abs(m.at[r, "window_s"] * 1e6 - t["window_us"]) <= TOL_US, (case, r)
        assert abs(m.at[r, "busy_s"] * 1e6 - t["busy_us"]) <= TOL_US, (case, r)
        assert abs(m.at[r, "comm_wait_s"] * 1e6 - sum(t["waits"].values())) <= TOL_US, (case, r)
        waits = ev[(ev["rank"] == r) & (ev["kind"] == "WAIT")]
        assert (waits["clock"] == "device").all()
        assert waits["name"].str.startswith("WAIT(ops)").all()
        if case not in NAMED:
            continue  # runs of kernels: which action waited is not in the trace
        got = {
            (s, mb, n.split("RECV_")[1][0]): (e - b) / 1e3
            for s, mb, n, b, e in zip(
                waits["stage"], waits["microbatch"], waits["name"], waits["start_ns"],
                waits["end_ns"], strict=True,
            )
        }  # fmt: skip
        want = {_direction(a): w for a, w in t["waits"].items()}
        assert got.keys() == want.keys(), (case, r)
        for k, w in want.items():
            assert abs(got[k] - w) <= TOL_US, (case, r, k, got[k], w)


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("slow")])
def test_the_rank_beside_a_slow_stage_waits(tmp_path, case):
    trace, truth = _read(tmp_path, case)
    m = rank_metrics(trace.events).set_index("rank")
    # rank 0 holds no slow stage: it waits for rank 1 most of its step
    assert m.at[0, "comm_wait_s"] > 0.2 * m.at[0, "window_s"]
    assert m.at[0, "bubble_ratio"] > 3 * m.at[1, "bubble_ratio"]


def test_schedule1f1b_gets_a_run_per_action_and_says_what_is_lost(tmp_path):
    trace, _ = _read(tmp_path, "1f1b")
    ev = trace.events
    for r in (0, 1):
        runs = ev[(ev["rank"] == r) & ev["kind"].isin(["F", "B"])]
        assert (runs["name"] == "ops").all() and (runs["clock"] == "device").all()
        assert (runs["kind"] == "F").sum() == (runs["kind"] == "B").sum() == 4
    assert "no actions" in trace.meta["note"] and trace.meta["ranks"] == 2


@pytest.mark.parametrize("case", ["zbv", "interleaved-slow", "gpipe"])
def test_metadata_comes_from_the_trace(tmp_path, case):
    trace, _ = _read(tmp_path, case)
    meta = trace.meta
    assert meta["impl"] == "torch" and meta["clock"] == "device"
    assert meta["ranks"] == 2 and meta["microbatches"] == 4
    assert meta["schedule"] == CASES[case][0]
