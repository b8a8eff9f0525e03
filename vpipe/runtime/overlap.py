"""Compute actions as three steps, and how an ``OVERLAP_F_B`` action runs its parts.

The executor compiles every F, B, I and W into ``Phases``: *fetch* obtains the input (a posted
receive is waited for only then), *compute* runs the stage's forward or backward on it, and
*deliver* hands the result on (into the neighbouring stage on this rank, or into the stage's
slot that SEND_F / SEND_B ships). A plain action is one call, compute with its fetch and
deliver bound. An overlap action gives its parts, as ``Part`` objects, to a runner:

- ``in_order`` (the default): the parts one after another, each fetching its input just before
  it computes, as the simulator models an overlap action.
- ``fused``: a forward-backward owned by the model (DualPipe's idea: interleave one
  microbatch's forward with another's backward, e.g. to hide communication).

Under the profiler each part is a span ``PP:{part}`` inside the compound's (``in_order``: the
part's fetch, compute and deliver; ``fused``: its compute), so a trace times each part by
the work it launched, not the pair as one.

The fused-hook protocol: when the compound is one F part and one B or I part and the F part's
stage module has a method ``overlapped_forward_backward``, the executor calls
``module.overlapped_forward_backward(forward, backward)`` with the two ``Part`` objects instead
of running them in order. The method chooses the order and interleaving of the parts' steps
(``fetch()``, ``compute()``, ``deliver()``: once each and in that order per part, or ``run()``
for all three) and must finish both parts before it returns. ``ready()`` says, without
blocking, whether a part's ``fetch()`` would return at once (its input handed over locally or
its posted receive complete), so the method can run the other part while a receive is in flight. A failure inside a part's step is
reported naming that part in the compound; one in the method's own code names the method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

from torch import nn
from torch.profiler import record_function

from vpipe.errors import PipelineError, one_line
from vpipe.ir import Action, Kind

__all__ = ["FUSED_HOOK", "Part", "PartFailed", "Phases", "overlap_runner"]

FUSED_HOOK = "overlapped_forward_backward"
_STEPS = ("fetch", "compute", "deliver")


class Phases(NamedTuple):
    """One compute action's steps. ``compute(fetch, deliver)`` obtains its input by calling
    ``fetch`` (None: it takes none), computes, and hands its result to ``deliver`` (None: the
    result stays in the stage). A plain action runs ``chained()``, with no call between the step
    loop and ``compute``; a ``Part`` runs the three steps separately."""

    fetch: Callable[[], Any] | None
    compute: Callable[[Callable[[], Any] | None, Callable[[Any], None] | None], None]
    deliver: Callable[[Any], None] | None
    ready: Callable[[], bool] | None = None  # whether fetch would not block; None: it never does

    def chained(self) -> Callable[[], None]:
        """The action as one call."""
        return partial(self.compute, self.fetch, self.deliver)


class PartFailed(Exception):
    """A part of an overlap action failed (carries which part)."""

    def __init__(self, part: Action, error: BaseException) -> None:
        super().__init__(part, error)
        self.part, self.error = part, error


class Part:
    """One compute action of an overlap action, stepped by a runner or a fused hook.

    ``fetch()`` returns the input (F: the input values; B/I: the output gradients, None on the
    loss stage), ``compute()`` the result (F: the outputs, or the loss on the loss stage; B/I:
    the input gradients), ``deliver()`` hands the result on. Each runs once, in that order.
    """

    __slots__ = ("action", "_phases", "_value", "_next", "_profiling", "_label")

    def __init__(
        self, action: Action, phases: Phases, profiling: Callable[[], bool] = lambda: False
    ) -> None:
        self.action = action
        self._phases = phases
        self._value: Any = None
        self._next = 0  # index in _STEPS of the next step; 3 once delivered
        # under the profiler a part's compute is a span of its own (PP:{part}), inside the
        # compound's: the trace then times each part by the GPU work it launched
        self._profiling = profiling
        self._label = f"PP:{action}"

    @property
    def done(self) -> bool:
        """Whether all three steps ran."""
        return self._next == len(_STEPS)

    def ready(self) -> bool:
        """Whether ``fetch()`` would not block: its input is handed over or its receive has
        completed (True once fetched). Never waits."""
        probe = self._phases.ready
        return self._next > 0 or probe is None or probe()

    def fetch(self) -> Any:
        """Obtain the input, waiting for its receive if it was posted."""
        return self._advance(0)

    def compute(self) -> Any:
        """Run the stage's forward or backward on the fetched input."""
        return self._advance(1)

    def deliver(self) -> None:
        """Hand the result on: to the neighbouring stage on this rank, or to its SEND."""
        self._advance(2)

    def run(self) -> None:
        """Fetch, compute and deliver."""
        for step in range(len(_STEPS)):
            self._advance(step)

    def reset(self) -> None:
        """Forget this execution (and any value it held) before the next."""
        self._value, self._next = None, 0

    def _advance(self, step: int) -> Any:
        if self._next != step:
            raise PartFailed(
                self.action,
                PipelineError(
                    f"{_STEPS[step]}() out of order: a part runs fetch(), compute(), deliver(), "
                    "once each, in that order"
                ),
            )
        fetch, compute, deliver, _ = self._phases
        try:
            if step == 0:
                self._value = fetch() if fetch is not None else None
            elif step == 1 and self._profiling():
                with record_function(self._label):
                    compute(self._fetched, self._keep)
            elif step == 1:
                compute(self._fetched, self._keep)
            elif deliver is not None:
                deliver(self._value)
        except Exception as e:
            raise PartFailed(self.action, e) from e
        self._next = step + 1
        if step == 2:
            self._value = None
        return self._value

    # compute's stand-ins for fetch and deliver: the value fetch() got, and where to keep the
    # result (even one that stays in the stage) until deliver()
    def _fetched(self) -> Any:
        value, self._value = self._value, None
        return value

    def _keep(self, result: Any) -> None:
        self._value = result


def in_order(parts: Sequence[Part]) -> Callable[[], None]:
    """The default runner: each part in turn, waiting for its own input just before it runs
    (under the profiler each part, its wait included, is a span ``PP:{part}`` of its own)."""
    steps = [(p.action, p._label, p._phases.chained()) for p in parts]
    profiling = parts[0]._profiling if parts else (lambda: False)

    def overlap() -> None:
        spans = profiling()
        for action, label, run in steps:
            try:
                if spans:
                    with record_function(label):
                        run()
                else:
                    run()
            except Exception as e:
                raise PartFailed(action, e) from e

    return overlap


def fused(hook: Callable[[Part, Part], Any], forward: Part, backward: Part) -> Callable[[], None]:
    """The runner that lets a stage module's ``overlapped_forward_backward`` step both parts."""
    owner = f"stage {forward.action.stage}'s {FUSED_HOOK}"

    def overlap() -> None:
        try:
            hook(forward, backward)
            for part in (forward, backward):
                if not part.done:
                    raise PartFailed(
                        part.action, PipelineError(f"{owner} returned before finishing it")
                    )
        except PartFailed:
            raise
        except Exception as e:
            raise PipelineError(f"{owner}: {one_line(e)}") from e
        finally:
            forward.reset()
            backward.reset()

    return overlap


def overlap_runner(
    parts: Sequence[Part], module_of: Callable[[int], nn.Module]
) -> Callable[[], None]:
    """The closure that runs one overlap action: the forward part's stage module's fused hook
    when the parts are one F and one B or I and the module has one, else ``in_order``."""
    kinds = [p.action.kind for p in parts]
    if len(parts) == 2 and Kind.F in kinds:
        forward, backward = parts if kinds[0] is Kind.F else parts[::-1]
        hook = getattr(module_of(forward.action.stage), FUSED_HOOK, None)
        if callable(hook) and backward.action.kind in (Kind.B, Kind.I):
            return fused(hook, forward, backward)
    return in_order(parts)
