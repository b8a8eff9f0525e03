"""A real trace of torch.distributed.pipelining's ZBV schedule converts: one row per executed
action of the profiled step, in torch's own order, with the right rank, stage, microbatch and
kind. The trace was recorded with ``python tests/data/record_torch_zbv.py`` (P=2, M=4,
gloo on CPU; each rank's program is embedded in the trace's metadata)."""

from pathlib import Path

from vpipe.ir import parse_action
from vpipe.trace.kineto import convert
from vpipe.trace.kineto_json import read_trace

DATA = Path(__file__).parent / "data" / "torch_zbv"
P, M = 2, 4


def test_torch_zbv_trace_converts():
    tr = convert([DATA])
    ev = tr.events
    assert tr.meta["impl"] == "torch" and tr.meta["schedule"] == "zbv"
    assert sorted(set(ev["rank"])) == [0, 1]
    assert set(ev["step"]) == {1}  # ProfilerStep#1: torch's runtime has no PP:STEP spans
    for rank in range(P):
        program = read_trace(DATA / f"rank{rank}.json.gz").header["vpipe"]["torch_program"]
        mine = ev[(ev["rank"] == rank) & (ev["kind"] != "WAIT") & (ev["name"] != "STEP")]
        assert list(mine["name"].astype(str)) == program
        for (_, row), text in zip(mine.iterrows(), program, strict=True):
            try:
                a = parse_action(text)
            except ValueError:  # UNSHARD, RESHARD, REDUCE_GRAD: torch-only bookkeeping
                assert row["kind"] == "other" and row["stage"] == -1
                continue
            assert (row["kind"], row["stage"], row["microbatch"]) == (
                a.kind.value,
                a.stage,
                a.microbatch,
            )
        compute = mine[mine["kind"].isin(["F", "I", "W", "B"])]
        assert set(compute["stage"]) == {rank, 2 * P - 1 - rank}  # V placement
        counts = compute.groupby(["stage", "kind"], observed=True).size()
        assert set(counts) == {M}  # F, I and W once per microbatch and stage
