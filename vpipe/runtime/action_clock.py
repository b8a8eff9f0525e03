"""Per-action device times from CUDA events, for timed steps.

On a GPU the host only enqueues an action's kernels; its host time is its launch. An
:class:`ActionClock` records a CUDA event on the stream the actions run on before and after
each action (and one after each wait for a received input), without synchronising: recording
an event is an enqueue, like a kernel. After the step's synchronise, :meth:`ActionClock.read`
turns them into device intervals relative to the step's first event. A consumer's wait on NCCL
makes the stream wait, not the host, so the device's wait for a receive is the time from the
action's start event to its after-wait event, and its compute the rest.

An event on an idle stream completes when the host records it, so a host stall inside an action
before its first kernel reads as that action's device time here; the profiler's device spans
(first kernel to last) do not count it (:mod:`vpipe.trace.device_clock`).

The event type, the stream and the synchronise are injectable (``event``, ``stream_of``), so
the protocol is tested without a GPU. Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ActionClock", "ActionTime"]


@dataclass(frozen=True)
class ActionTime:
    """One action's device interval in a step, in ns after the step's first event; ``ready_ns``
    is when its received input was there (after its wait), None if it waited for none."""

    action: str
    start_ns: int
    end_ns: int
    ready_ns: int | None = None

    @property
    def wait_ns(self) -> int:
        """The device's wait for the action's received input (0 without one)."""
        return 0 if self.ready_ns is None else max(0, self.ready_ns - self.start_ns)


class ActionClock:
    """CUDA event pairs for the actions of one rank's program, reused every step.

    The executor hands its program to :meth:`run` (:meth:`begin` once per step, :meth:`start`
    and :meth:`end` around action i) and calls :meth:`waited` after waiting for an input; none
    of these synchronises.
    :meth:`read` (after the step) waits for the last event and returns the intervals.
    """

    def __init__(
        self,
        actions: Sequence[Any],
        device: Any = None,
        *,
        event: Callable[[], Any] | None = None,
        stream_of: Callable[[Any], Any] | None = None,
    ) -> None:
        if event is None or stream_of is None:
            import torch

            event = event or (lambda: torch.cuda.Event(enable_timing=True))
            stream_of = stream_of or torch.cuda.current_stream
        self.names = [str(a) for a in actions]
        self.device = device
        self._stream_of = stream_of
        self._stream: Any = None
        self._origin = event()
        self._starts = [event() for _ in self.names]
        self._ends = [event() for _ in self.names]
        self._ready = [event() for _ in self.names]
        self._waited: list[bool] = [False] * len(self.names)
        self._current = -1
        self.action: Any = None  # the action running (see run)

    def run(self, program: Sequence[tuple[Any, str, Callable[[], None]]], spans: bool) -> None:
        """Run the executor's compiled program (action, span label, closure) once, each action
        between its events, inside its profiler span when ``spans``; ``action`` names the one
        running (the failed one after an exception)."""
        from contextlib import nullcontext

        from torch.profiler import record_function

        self.begin()
        for i, (action, label, fn) in enumerate(program):
            self.action = action
            with record_function(label) if spans else nullcontext():
                self.start(i)
                fn()
                self.end(i)

    def begin(self) -> None:
        """Mark the step's start on the stream the actions run on (this step's current one)."""
        self._stream = self._stream_of(self.device)
        self._waited = [False] * len(self.names)
        self._origin.record(self._stream)

    def start(self, i: int) -> None:
        self._current = i
        self._starts[i].record(self._stream)

    def end(self, i: int) -> None:
        self._ends[i].record(self._stream)

    def waited(self) -> None:
        """After the current action's wait for an input (the last one, if it has several)."""
        i = self._current
        if i >= 0:
            self._ready[i].record(self._stream)
            self._waited[i] = True

    def read(self) -> list[ActionTime]:
        """The step's action intervals (ns after its first event), once its events are done."""
        if not self.names:
            return []
        self._ends[-1].synchronize()
        origin = self._origin

        def ns(e: Any) -> int:
            return round(origin.elapsed_time(e) * 1e6)  # elapsed_time is in milliseconds

        return [
            ActionTime(
                name,
                ns(self._starts[i]),
                ns(self._ends[i]),
                ns(self._ready[i]) if self._waited[i] else None,
            )
            for i, name in enumerate(self.names)
        ]
