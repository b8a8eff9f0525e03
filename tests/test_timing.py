"""Step timing: the host clock on CPUs, a CUDA event pair on GPUs (the CUDA branch runs here
against a stand-in for torch.cuda's events, so its structure is checked without a GPU)."""

import time

import pytest
import torch

from vpipe.timing import step_seconds


def test_cpu_steps_use_the_host_clock(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", lambda **_: pytest.fail("CUDA event on the CPU"))
    dt = step_seconds(lambda: time.sleep(0.02), torch.device("cpu"))
    assert 0.02 <= dt < 1.0


def test_cuda_steps_use_an_event_pair_read_after_synchronize(monkeypatch):
    log: list[str] = []

    class FakeEvent:
        """Records the host clock where a CUDA event records the stream's position."""

        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.t = float("nan")

        def record(self) -> None:
            self.t = time.perf_counter()
            log.append("record")

        def elapsed_time(self, end: "FakeEvent") -> float:
            assert log[-1] == "synchronize"  # read only once the device has finished
            return (end.t - self.t) * 1e3  # milliseconds, as torch.cuda.Event's

    def synchronize(device: torch.device) -> None:
        log.append("synchronize")
        assert device == torch.device("cuda", 0)

    def step() -> None:
        log.append("step")
        time.sleep(0.02)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    dt = step_seconds(step, torch.device("cuda", 0))
    assert log == ["record", "step", "record", "synchronize"]
    assert 0.02 <= dt < 1.0  # seconds, not milliseconds
