"""Per-action CUDA event pairs, with stand-in events and stream: where each event is recorded,
that nothing waits for the device inside a step, and how the intervals are read after it."""

import itertools

import pytest
import torch
from torch import nn

from vpipe.ir import parse_action
from vpipe.runtime import Pipeline
from vpipe.runtime.action_clock import ActionClock, ActionTime
from vpipe.runtime.executor import Posted
from vpipe.schedules import make_schedule


class FakeEvent:
    """Logs what is done with it; its time is a tick of a fake device clock (1 ms each)."""

    ids = itertools.count()
    ticks = itertools.count(1)

    def __init__(self, log):
        self.log, self.id, self.t = log, next(self.ids), None

    def record(self, stream=None):
        self.t = next(self.ticks)
        self.log.append(("record", self.id, stream))

    def synchronize(self):
        self.log.append(("synchronize", self.id))

    def query(self):
        self.log.append(("query", self.id))
        return True

    def elapsed_time(self, other):
        self.log.append(("elapsed", other.id))
        return float(other.t - self.t)


class Work:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append(("work.wait",))
        return True


@pytest.fixture
def pipe_and_log(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append(("cuda.synchronize",)))
    monkeypatch.setattr(torch.cuda, "Event", lambda **k: pytest.fail("a real CUDA event"))
    torch.manual_seed(0)
    schedule = make_schedule("zbv", 1, 2)  # stages 0 and 1 on one rank: F, I, W each
    modules = {0: nn.Linear(4, 4), 1: nn.Linear(4, 4)}
    pipe = Pipeline(schedule, modules, lambda out, y: ((out - y) ** 2).mean(), time_actions=True)
    assert pipe._executor.clock is None  # a CPU device: no events, the plain loop
    ex = pipe._executor
    ex._program = [
        (a, label, lambda fn=fn, a=a: (log.append(("run", str(a))), fn())[1])
        for a, label, fn in ex._program
    ]
    actions = [a for a, _, _ in ex._program]
    ex.clock = ActionClock(
        actions, "cuda:1", event=lambda: FakeEvent(log), stream_of=lambda d: f"stream of {d}"
    )
    return pipe, log, actions


def test_events_around_each_action_and_no_sync_inside_the_step(pipe_and_log):
    pipe, log, actions = pipe_and_log
    clock = pipe._executor.clock
    origin, starts, ends = (
        clock._origin.id,
        [e.id for e in clock._starts],
        [e.id for e in clock._ends],
    )
    pipe.step(torch.randn(8, 4), torch.randn(8, 4))
    stream = "stream of cuda:1"
    want = [("record", origin, stream)]
    for i, a in enumerate(actions):
        want += [("record", starts[i], stream), ("run", str(a)), ("record", ends[i], stream)]
    step_part = log[: len(want)]
    assert step_part == want  # only enqueues while the step runs: nothing waits for the device
    after = log[len(want) :]
    assert after[0] == ("synchronize", ends[-1])  # read once the last event is done
    assert all(e[0] in ("elapsed", "synchronize") for e in after)
    times = pipe.stats["action_times"]
    assert [t.action for t in times] == [str(a) for a in actions]
    # fake clock: 1 ms per record, origin at tick t0, action i's events 2i+1 and 2i+2 later
    assert [(t.start_ns, t.end_ns) for t in times] == [
        ((2 * i + 1) * 10**6, (2 * i + 2) * 10**6) for i in range(len(actions))
    ]
    assert all(t.ready_ns is None and t.wait_ns == 0 for t in times)


def test_wait_for_a_received_input_records_when_it_was_there(pipe_and_log):
    pipe, log, _ = pipe_and_log
    ex, clock = pipe._executor, pipe._executor.clock
    clock.begin()
    for i in range(len(clock.names)):
        clock.start(i)
        if i == 2:
            log.clear()
            ex._wait(Posted((), parse_action("1RECV_F0"), [Work(log), Work(log)]))
            ready = ("record", clock._ready[2].id, clock._stream)
            assert log == [("work.wait",), ("work.wait",), ready]
        clock.end(i)
    got = clock.read()[2]
    assert got.ready_ns is not None and got.start_ns < got.ready_ns < got.end_ns
    assert got.wait_ns == got.ready_ns - got.start_ns


def test_a_failing_action_is_named():
    log = []
    clock = ActionClock(["0F0", "0F1"], None, event=lambda: FakeEvent(log), stream_of=lambda d: 0)

    def boom():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        clock.run([("0F0", "PP:0F0", lambda: None), ("0F1", "PP:0F1", boom)], spans=False)
    assert clock.action == "0F1"
    assert ActionTime("0F0", 5, 9, 7).wait_ns == 2
