"""Why vpipe's P2P posts on one process group per direction on NCCL (vpipe/runtime/comm.py),
checked on a model of NCCL's execution, as no GPU is needed to see it.

Per rank, a compute stream runs the compute actions in order, each after the receive that
feeds it. Point-to-point operations run on streams: one starts once the previous one on its
stream has finished and so has the compute enqueued before it (ProcessGroupNCCL makes its
stream wait for the current one), and finishes once it and its match on the peer have both
started (a large message moves only while both kernels run). Operations posted together with
batch_isend_irecv form one NCCL group: they start and finish together. ProcessGroupNCCL puts
batched operations on the group's one stream; vpipe's channels give each direction between two
ranks a stream and post every operation alone.
"""

from __future__ import annotations

from collections import defaultdict, deque

import pytest

from vpipe.ir import Schedule
from vpipe.ir.lowering import lower
from vpipe.schedules import make_schedule, schedule_names

_NEEDS = {"F": "RECV_F", "B": "RECV_B", "I": "RECV_B"}


def _message(a) -> tuple[str, int, int]:
    """(direction, boundary, microbatch) of a SEND/RECV action."""
    k = a.kind.value
    boundary = a.stage - (k in ("RECV_F", "SEND_B"))
    return k[-1], boundary, a.microbatch


def _peer(schedule: Schedule, a) -> int:
    up = a.kind.value in ("SEND_F", "RECV_B")
    return schedule.placement[a.stage + 1 if up else a.stage - 1]


def hangs(schedule: Schedule, channels: bool) -> bool:
    """Whether a lowered program deadlocks: ``channels`` posts each operation alone on the
    stream of its (peer, direction), else each batch is one group on the rank's one stream."""
    succ: dict[tuple, list[tuple]] = defaultdict(list)
    nodes: set[tuple] = set()

    def edge(a: tuple, b: tuple) -> None:
        succ[a].append(b)
        nodes.update((a, b))

    unit_of, recv_unit = {}, {}
    for r, program in enumerate(schedule.actions):
        last_compute, batch, prev_on = None, [], {}
        for i, a in enumerate(program + [None]):
            if a is not None and a.is_comm:
                batch.append((i, a))
                continue
            groups = defaultdict(list)  # this batch's units, by (stream, first operation)
            for j, c in batch:
                if channels:
                    groups[(_peer(schedule, c), c.kind.value[:4]), j].append((j, c))
                else:
                    groups[0, 0].append((j, c))
            for (stream, _), ops in groups.items():
                unit = ("unit", r, ops[0][0])
                edge(("S", unit), ("D", unit))
                if stream in prev_on:
                    edge(("D", prev_on[stream]), ("S", unit))
                if last_compute is not None:
                    edge(("D", last_compute), ("S", unit))
                prev_on[stream] = unit
                for j, c in ops:
                    unit_of[r, j] = unit
                    if c.kind.value.startswith("RECV"):
                        recv_unit[r, c.stage, c.kind.value, c.microbatch] = unit
            batch = []
            if a is None:
                break
            node = ("C", r, i)
            nodes.add(("D", node))
            if last_compute is not None:
                edge(("D", last_compute), ("D", node))
            for part in a.parts or (a,):
                need = recv_unit.get((r, part.stage, _NEEDS.get(part.kind.value), part.microbatch))
                if need is not None:
                    edge(("D", need), ("D", node))
            last_compute = node
    # a unit finishes once each of its operations' matches has started
    sends, recvs = {}, {}
    for r, program in enumerate(schedule.actions):
        for i, a in enumerate(program):
            if a.is_comm:
                (sends if a.kind.value.startswith("SEND") else recvs)[_message(a)] = unit_of[r, i]
    for msg, s in sends.items():
        edge(("S", recvs[msg]), ("D", s))
        edge(("S", s), ("D", recvs[msg]))
    indegree = defaultdict(int)
    for a in succ:
        for b in succ[a]:
            indegree[b] += 1
    ready = deque(n for n in nodes if indegree[n] == 0)
    seen = 0
    while ready:
        n = ready.popleft()
        seen += 1
        for b in succ[n]:
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    return seen < len(nodes)


def test_one_stream_per_rank_hangs_every_family():
    """What batch_isend_irecv on one process group would do: receives posted ahead block the
    sends behind them (at the default lookahead 1 for all but zb-h2, at 2 for every family)."""
    for name in schedule_names():
        programs = [lower(make_schedule(name, 2, 8), recv_lookahead=k) for k in (1, 2)]
        assert any(hangs(s, channels=False) for s in programs), name


@pytest.mark.parametrize("n_ranks", [2, 4])
def test_channels_never_hang(n_ranks):
    for name in schedule_names():
        for lookahead in (0, 1, 2, 3):
            s = lower(make_schedule(name, n_ranks, 8), recv_lookahead=lookahead)
            assert not hangs(s, channels=True), (name, lookahead)
