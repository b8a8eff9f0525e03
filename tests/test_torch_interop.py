"""CSV interop with the installed torch.distributed.pipelining, in both directions.

Torch's schedule classes only read a few attributes of their stage objects (index, stage
count, group size and rank) while they build the action order, so a plain stand-in object is
enough here, as in torch's own schedule tests: no process group, no model.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from vpipe.cli import main
from vpipe.ir import Kind, Schedule, format_action, v_placement

torch = pytest.importorskip("torch")
tsched = pytest.importorskip("torch.distributed.pipelining.schedules")

# torch class name -> (stages per rank, [(ranks, microbatches), ...])
TORCH_SCHEDULES = {
    "ScheduleZBVZeroBubble": (2, [(2, 4), (4, 8), (3, 5)]),
    "ScheduleDualPipeV": (2, [(2, 4), (4, 8), (3, 6)]),
    "ScheduleInterleaved1F1B": (2, [(2, 4), (4, 8), (3, 5)]),
    "ScheduleInterleavedZeroBubble": (2, [(2, 4), (4, 8), (3, 6)]),
    "ScheduleLoopedBFS": (3, [(2, 4), (4, 8), (3, 5)]),
}
TORCH_CASES = [
    pytest.param(cls, v, p, m, id=f"{cls}-P{p}-M{m}")
    for cls, (v, sizes) in TORCH_SCHEDULES.items()
    for p, m in sizes
]

# vpipe schedule -> sizes (ranks, microbatches) that every family accepts.
VPIPE_SIZES = [(2, 4), (4, 8)]


class StubStage:
    """The attributes torch's schedule constructors read from a pipeline stage."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.submod = None  # read by torch's torch.compile compatibility check
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1


def rank0_stages(placement: dict[int, int], n_ranks: int) -> list[StubStage]:
    n = len(placement)
    return [StubStage(s, n, n_ranks, 0) for s in sorted(placement) if placement[s] == 0]


def torch_schedule(cls_name: str, v: int, p: int, m: int):
    cls = getattr(tsched, cls_name, None)
    if cls is None:
        pytest.skip(f"torch {torch.__version__} has no {cls_name}")
    n = p * v
    placement = (
        v_placement(p, n)
        if cls_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
        else {s: s % p for s in range(n)}
    )
    return cls(rank0_stages(placement, p), m)


def torch_rows(order: dict) -> list[list[str]]:
    """torch's per-rank action lists as strings, idle (None) slots dropped."""
    return [[str(a) for a in order[r] if a is not None] for r in sorted(order)]


def read_rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return [[c for c in row if c] for row in csv.reader(f)]


# ---------------------------------------------------------------------------------------------
# torch -> vpipe


@pytest.mark.parametrize("cls_name,v,p,m", TORCH_CASES)
def test_torch_dump_imports_validates_lowers_simulates(tmp_path, cls_name, v, p, m):
    from vpipe.ir.lowering import lower, validate
    from vpipe.sim import simulate

    ts = torch_schedule(cls_name, v, p, m)
    path = tmp_path / f"{cls_name}.csv"
    ts._dump_csv(str(path), format="compute_only")

    s = Schedule.from_csv(path, n_ranks=p)
    assert (s.n_ranks, s.n_stages, s.n_microbatches) == (p, p * v, m)
    assert s.placement == dict(ts.stage_index_to_group_rank)
    assert s.to_rows() == torch_rows(ts.pipeline_order)
    validate(s)

    lowered = lower(s)
    validate(lowered)
    for r, _, a in lowered.iter_actions():
        if a.is_comm:  # comm only across ranks: same-rank neighbours hand over locally
            peer_stage = a.stage + 1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else a.stage - 1
            assert s.placement[peer_stage] != r, f"rank {r}: {a} talks to its own rank"

    result = simulate(s)
    timeline = result.timeline
    compute = timeline[timeline["kind"].astype(str).isin(["F", "B", "I", "W"])]
    parts = sorted(str(p) for _, _, a in s.iter_actions() for p in a.compute_parts())
    assert sorted(compute["name"]) == parts
    assert result.makespan > 0


@pytest.mark.parametrize(
    "cls_name,v,p,m",
    [pytest.param(c, v, *sizes[1], id=c) for c, (v, sizes) in TORCH_SCHEDULES.items()],
)
def test_torch_lowered_dump_validates_in_vpipe(tmp_path, cls_name, v, p, m):
    """torch's own lowered program (compute_comms) passes vpipe's lowered-program checks once
    the FSDP-only UNSHARD/RESHARD/REDUCE_GRAD cells are dropped."""
    from vpipe.ir.lowering import validate

    ts = torch_schedule(cls_name, v, p, m)
    path = tmp_path / "comms.csv"
    ts._dump_csv(str(path), format="compute_comms")
    fsdp = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
    rows = [[c for c in row if not c.endswith(fsdp)] for row in read_rows(path)]
    text = "\n".join(",".join(row) for row in rows) + "\n"
    s = Schedule.from_csv(text, n_ranks=p)
    assert s.is_lowered or p == 1
    validate(s)


def test_cli_validates_and_simulates_torch_dump(tmp_path, capsys):
    ts = torch_schedule("ScheduleDualPipeV", 2, 4, 8)
    path = tmp_path / "dualpipev.csv"
    ts._dump_csv(str(path), format="compute_only")
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.strip() == (
        "valid: 4 ranks, 8 stages, 8 microbatches, placement v"
    )
    assert main(["simulate", str(path), "--json"]) == 0
    assert '"makespan"' in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# vpipe -> torch


def _vpipe_cases():
    from vpipe.schedules import schedule_names

    return [
        pytest.param(name, p, m, id=f"{name}-P{p}-M{m}")
        for name in schedule_names()
        for p, m in VPIPE_SIZES
    ]


def runtime_for(s: Schedule, microbatches: int | None = None):
    """An empty torch _PipelineScheduleRuntime shaped like ``s`` (rank 0's view)."""
    return tsched._PipelineScheduleRuntime(
        rank0_stages(s.placement, s.n_ranks), microbatches or s.n_microbatches
    )


@pytest.mark.parametrize("name,p,m", _vpipe_cases())
def test_vpipe_export_loads_in_torch(tmp_path, name, p, m):
    from vpipe.ir.lowering import lower
    from vpipe.schedules import make_schedule

    s = make_schedule(name, p, m)
    compute_csv = tmp_path / "compute.csv"
    s.to_csv(compute_csv)
    rt = runtime_for(s)
    rt._load_csv(str(compute_csv), format="compute_only")
    assert torch_rows(rt.pipeline_order) == s.to_rows()
    assert dict(rt.stage_index_to_group_rank) == s.placement
    assert len(rt.pipeline_order_with_comms) == p  # torch lowered it too

    lowered = lower(s)
    comms_csv = tmp_path / "comms.csv"
    lowered.to_csv(comms_csv)
    rt = runtime_for(s)
    rt._load_csv(str(comms_csv), format="compute_comms")
    assert torch_rows(rt.pipeline_order_with_comms) == lowered.to_rows()
    assert dict(rt.stage_index_to_group_rank) == s.placement


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "interleaved-1f1b"])
def test_torchtitan_style_csv_from_cli(tmp_path, capsys, name):
    """torchtitan's ``pipeline_parallel_schedule_csv`` builds a _PipelineScheduleRuntime and
    calls ``_load_csv(path)`` (compute_only); feed it the file ``vpipe show --csv`` writes."""
    path = tmp_path / f"{name}.csv"
    assert main(["show", name, "--ranks", "4", "--microbatches", "8", "--csv", str(path)]) == 0
    capsys.readouterr()
    s = Schedule.from_csv(path)
    rt = tsched._PipelineScheduleRuntime(
        rank0_stages(s.placement, 4), n_microbatches=8, loss_fn=None, scale_grads=False
    )
    rt._load_csv(str(path))
    assert [[format_action(a) for a in row] for row in s.actions] == torch_rows(rt.pipeline_order)
    assert read_rows(path) == s.to_rows()


@pytest.mark.parametrize(
    "cls_name,name,v",
    [
        ("ScheduleZBVZeroBubble", "zbv", 2),
        ("ScheduleDualPipeV", "dualpipev", 2),
        ("ScheduleInterleaved1F1B", "interleaved-1f1b", 2),
        ("ScheduleInterleavedZeroBubble", "zb-h1", 2),
        ("ScheduleLoopedBFS", "looped-bfs", 2),
    ],
)
def test_vpipe_schedule_no_slower_than_torchs(tmp_path, cls_name, name, v):
    """Under unit costs, each vpipe family takes no longer than torch's counterpart at the
    same size, on the same placement."""
    from vpipe.schedules import make_schedule
    from vpipe.sim import simulate

    p, m = 4, 8
    path = tmp_path / "torch.csv"
    torch_schedule(cls_name, v, p, m)._dump_csv(str(path), format="compute_only")
    theirs = Schedule.from_csv(path)
    ours = make_schedule(name, p, m, v)
    assert ours.placement == theirs.placement
    assert simulate(ours).makespan <= simulate(theirs).makespan
