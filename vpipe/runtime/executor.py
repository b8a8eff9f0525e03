"""Runs one rank's lowered program for one step.

The program is compiled once into a list of closures, one per action, with every lookup that
does not depend on the step (stage objects, peers, where a result goes) bound in advance; the
step loop only calls them. ``_HANDLERS`` maps each action kind to its compile function, and
``_PHASES`` each compute kind to its fetch/compute/deliver steps (overlap.py), which a plain
action chains and an ``OVERLAP_F_B`` hands, per part, to its runner (in order, or the stage
module's ``overlapped_forward_backward``). Results move between actions through the stages'
per-microbatch dicts:

- F(s) on a rank that also holds s+1 puts its output, detached, straight into stage s+1's
  ``fwd_in`` (local handoff: no copy, no communication); otherwise SEND_F ships it.
- B/I(s+1) on a rank that also holds s puts its input gradient straight into stage s's
  ``grad_out``; otherwise it waits in ``grad_in`` for SEND_B.
- RECV_F/RECV_B post receives into fresh buffers where the program puts them and leave a
  ``Posted`` entry; the consuming compute waits on it just before it runs (span
  ``PP:WAIT:{recv action}``). Adjacent communication actions are posted as one batch. Sends are
  completed by the end of the step.
- A bundle (:mod:`vpipe.ir.bundling`: messages to one peer posted in one batch on both sides)
  travels packed in one byte buffer: its last SEND posts the copy of all its tensors, its first
  RECV posts one receive whose views each RECV's entry holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from operator import getitem
from typing import Any

import torch
from torch.profiler import record_function

from vpipe.errors import PipelineError, one_line
from vpipe.ir import Action, Kind
from vpipe.runtime.comm import P2P
from vpipe.runtime.meta import TensorMeta
from vpipe.runtime.overlap import Part, PartFailed, Phases, overlap_runner
from vpipe.runtime.packing import WaitOnce, pack, packed_buffer
from vpipe.runtime.stage import Stage

__all__ = ["Executor"]

_detach = torch.Tensor.detach  # mapped over a handed-over tuple: no generator per forward


class Posted:
    """A posted receive: its buffers, its works, and the action that posted it."""

    __slots__ = ("bufs", "works", "action")

    def __init__(
        self, bufs: tuple[torch.Tensor, ...], action: Action, works: list | None = None
    ) -> None:
        self.bufs = bufs
        self.works: list = [] if works is None else works  # shared by a bundle's receives
        self.action = action


class _BundleReceive:
    """A bundle's queued receive: its works go to the list its RECVs' entries share."""

    __slots__ = ("works",)

    def __init__(self, works: list) -> None:
        self.works = works


def _arrived(slot: dict, m: int) -> Callable[[], bool]:
    """A probe of microbatch m's entry in ``slot``: False while it is a posted receive with a
    work not yet completed (a missing entry is "ready": fetching it fails at once)."""

    def arrived() -> bool:
        v = slot.get(m)
        return type(v) is not Posted or all(w.is_completed() for w in v.works)

    return arrived


class _WaitFailed(Exception):
    def __init__(self, action: Action, error: BaseException) -> None:
        super().__init__(action, error)
        self.action, self.error = action, error


class Executor:
    """One rank's program, compiled to closures, with live-activation accounting."""

    def __init__(
        self,
        rank: int,
        program: list[Action],
        stages: dict[int, Stage],
        placement: dict[int, int],
        comm: P2P | None,
        device: torch.device,
        bundles: list[tuple[Action, ...]] = (),
    ) -> None:
        self.rank = rank
        self.stages = stages
        self.placement = placement
        self.n_stages = len(placement)
        self.comm = comm
        self.device = device
        self.profiling = False
        self.clock: Any = None  # an ActionClock (action_clock.py): device times of the actions
        self._inputs: list[tuple[torch.Tensor, ...]] = []
        self._targets: list[Any] = []
        self._losses: list[torch.Tensor | None] = []
        # per queued op: its receive (a bundle's: _BundleReceive), or the sent tensor
        self._queued: list[Posted | _BundleReceive | torch.Tensor] = []
        self._sends: deque[tuple[list, list[torch.Tensor]]] = deque()  # works, tensors sent
        self.live = self.live_bytes = self.peak_live = self.peak_live_bytes = 0
        self._bundle_of = {a: b for b in bundles for a in b}  # see vpipe.ir.bundling
        self._pending: dict[tuple[Action, ...], list[torch.Tensor]] = {}
        self._program = [(a, f"PP:{a}", self._compile(program, i)) for i, a in enumerate(program)]

    # -- running -----------------------------------------------------------------------------
    def run(
        self, inputs: list[tuple[torch.Tensor, ...]], targets: list[Any], n_microbatches: int
    ) -> list[torch.Tensor] | None:
        """Execute the program once; return the per-microbatch losses on the loss rank."""
        self._inputs[:] = inputs  # in place: stage 0's F fetches from this list
        self._targets = targets
        self._losses = [None] * n_microbatches
        self.peak_live, self.peak_live_bytes = self.live, self.live_bytes
        action, clock = None, self.clock
        try:
            if clock is not None:  # CUDA events around each action (action_clock.py)
                clock.run(self._program, self.profiling)
            elif self.profiling:
                for action, label, fn in self._program:  # noqa: B007 (named on failure)
                    with record_function(label):
                        fn()
            else:
                for action, _, fn in self._program:  # noqa: B007 (named on failure)
                    fn()
            self._finish_sends()
        except Exception as e:
            action = clock.action if clock is not None else action
            raise self._describe(action, e) from e
        finally:
            self._inputs.clear()
            self._targets = []
        losses, self._losses = self._losses, []
        if self.n_stages - 1 not in self.stages:
            return None
        missing = [m for m, v in enumerate(losses) if v is None]
        if missing:
            raise PipelineError(
                f"rank {self.rank}: the program computed no loss for microbatch {missing[0]}"
            )
        return losses

    def leftovers(self) -> int:
        """Stashed entries left over by the last step (0 for a complete program)."""
        return sum(st.live_entries() for st in self.stages.values())

    def reset(self) -> None:
        """Drop every stashed value (after a failed step)."""
        for st in self.stages.values():
            st.clear()
        self._queued.clear()
        self._sends.clear()
        for pending in self._pending.values():
            pending.clear()
        self.live = self.live_bytes = 0
        if self.comm is not None:
            self.comm.discard()

    def _describe(self, action: Action | None, e: Exception) -> PipelineError:
        where = f"rank {self.rank}"
        if action is None:
            return PipelineError(f"{where}: {one_line(e)}")
        shown, part = str(action), action
        if isinstance(e, PartFailed):
            part, e = e.part, e.error
            shown = f"{part} in {action}"
        detail = ""
        if isinstance(e, _WaitFailed):
            src = self.placement.get(e.action.stage + (-1 if e.action.kind is Kind.RECV_F else 1))
            detail = f"waiting for {e.action} from rank {src}: "
            e = e.error
        text = str(e) if isinstance(e, PipelineError) else one_line(e)
        # An overlap action not failed in a part (its fused hook's own code) has no stage.
        at = f" (stage {part.stage}, microbatch {part.microbatch})" if part.stage >= 0 else ""
        return PipelineError(f"{where}: action {shown}{at} failed: {detail}{text}")

    # -- helpers used by the closures --------------------------------------------------------
    def _wait(self, posted: Posted) -> tuple[torch.Tensor, ...]:
        try:
            if self.profiling:
                with record_function(f"PP:WAIT:{posted.action}"):
                    for w in posted.works:
                        w.wait()
            else:
                for w in posted.works:
                    w.wait()
        except Exception as e:
            raise _WaitFailed(posted.action, e) from e
        if self.clock is not None:
            self.clock.waited()
        return posted.bufs

    def _flush(self) -> None:
        # A coalesced batch gives all its operations one works list: a receive takes it once,
        # and its sends share one entry.
        works = self.comm.flush()
        sends = self._sends
        posted = posted_works = None  # the receive last given works, and those works
        for owner, w in zip(self._queued, works, strict=True):
            if type(owner) is _BundleReceive:
                owner.works.extend(map(WaitOnce, w))
            elif type(owner) is Posted:
                if owner is not posted or w is not posted_works:
                    owner.works.extend(w)
                    posted, posted_works = owner, w
            elif sends and sends[-1][0] is w:
                sends[-1][1].append(owner)
            else:
                sends.append((w, [owner]))  # keeps the tensors alive until sent
        self._queued.clear()  # in place: the closures hold this list

    def _finish_sends(self) -> None:
        sends, self._sends = self._sends, deque()
        for works, _ in sends:
            for w in works:
                w.wait()

    def _prune_sends(self) -> None:
        sends = self._sends
        while sends and all(w.is_completed() for w in sends[0][0]):
            sends.popleft()

    def _add_live(self, units: int, nbytes: int) -> None:
        self.live += units
        self.live_bytes += nbytes
        if self.live > self.peak_live:
            self.peak_live = self.live
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes

    # -- compilation -------------------------------------------------------------------------
    def _compile(self, program: list[Action], i: int) -> Callable[[], None]:
        a = program[i]
        fn = _HANDLERS[a.kind](self, a)
        if not a.is_comm or (i + 1 < len(program) and program[i + 1].is_comm):
            return fn  # compute, or a post that the next action's batch joins
        flush = self._flush

        def post_and_flush() -> None:
            fn()
            flush()

        return post_and_flush

    def _compile_plain(self, a: Action) -> Callable[[], None]:
        """F, B, I or W: its phases as one call."""
        return _PHASES[a.kind](self, a).chained()

    def _compile_overlap(self, a: Action) -> Callable[[], None]:
        """OVERLAP_F_B: its parts handed to their runner (overlap.py)."""
        parts = [Part(p, _PHASES[p.kind](self, p), lambda: self.profiling) for p in a.parts]
        return overlap_runner(parts, lambda s: self.stages[s].module)

    # -- compute phases (overlap.py) ---------------------------------------------------------
    def _forward_phases(self, a: Action) -> Phases:
        s, m = a.stage, a.microbatch
        st = self.stages[s]
        nxt = self.stages.get(s + 1)
        last = st.is_last
        add_live = self._add_live

        def forward(fetch: Callable[[], Any], deliver: Callable[[Any], None] | None) -> None:
            out = st.forward(m, fetch(), self._targets[m] if last else None)
            if deliver is not None:
                deliver(out)
            add_live(1, st.act_bytes or 0)

        if last:

            def deliver(loss: torch.Tensor) -> None:
                self._losses[m] = loss.detach()

        elif nxt is not None:  # local handoff

            def deliver(outs: tuple[torch.Tensor, ...]) -> None:
                nxt.fwd_in[m] = tuple(map(_detach, outs))

        else:
            deliver, st.sends_outputs = None, True  # SEND_F ships the stashed outputs
        if st.is_first:
            return Phases(partial(getitem, self._inputs, m), forward, deliver)
        fetch = self._taker(st.fwd_in, m, "input")
        return Phases(fetch, forward, deliver, _arrived(st.fwd_in, m))

    def _backward_phases(self, a: Action) -> Phases:
        st, m = self.stages[a.stage], a.microbatch
        last = st.is_last
        add_live = self._add_live

        def backward(fetch: Callable[[], Any], deliver: Callable[[Any], None] | None) -> None:
            got = st.backward(m, None if last else fetch())
            if deliver is not None:
                deliver(got)
            add_live(0, st.recompute_bytes)  # what it recomputed, alive while it ran
            add_live(-1, -(st.act_bytes or 0) - st.recompute_bytes)

        return Phases(self._grads_from(a), backward, self._grads_to(a), self._grads_ready(a))

    def _backward_input_phases(self, a: Action) -> Phases:
        st, m = self.stages[a.stage], a.microbatch
        last, add_live = st.is_last, self._add_live

        def backward_input(fetch: Callable[[], Any], deliver: Callable[[Any], None] | None) -> None:
            got = st.backward_input(m, None if last else fetch())
            if deliver is not None:
                deliver(got)
            add_live(0, st.recompute_bytes)  # held until W

        return Phases(self._grads_from(a), backward_input, self._grads_to(a), self._grads_ready(a))

    def _backward_weight_phases(self, a: Action) -> Phases:
        st, m = self.stages[a.stage], a.microbatch
        add_live = self._add_live

        def backward_weight(fetch: Any, deliver: Any) -> None:  # no input; result in .grad
            if m not in st.weight:
                raise PipelineError(f"W before I for microbatch {m}")
            st.backward_weight(m)
            add_live(-1, -(st.act_bytes or 0) - st.recompute_bytes)

        return Phases(None, backward_weight, None)

    def _grads_from(self, a: Action) -> Callable[[], Any] | None:
        """B/I's fetch: the output gradient (none on the loss stage)."""
        st = self.stages[a.stage]
        return None if st.is_last else self._taker(st.grad_out, a.microbatch, "output gradient")

    def _grads_ready(self, a: Action) -> Callable[[], bool] | None:
        """B/I's readiness probe: whether its output gradient is here (none needed: None)."""
        st = self.stages[a.stage]
        return None if st.is_last else _arrived(st.grad_out, a.microbatch)

    def _grads_to(self, a: Action) -> Callable[[tuple], None] | None:
        """B/I's deliver: the input gradient into stage s-1 here, else SEND_B's slot; from stage
        0 nowhere."""
        s, m = a.stage, a.microbatch
        if s == 0:
            return None
        prev = self.stages.get(s - 1)
        slot = prev.grad_out if prev is not None else self.stages[s].grad_in

        def deliver(grads: tuple) -> None:
            slot[m] = grads

        return deliver

    def _taker(self, slot: dict, m: int, what: str) -> Callable[[], Any]:
        """A fetch of microbatch m's entry in ``slot``: handed over, or a posted receive, which
        is waited for now."""
        wait = self._wait

        def take() -> Any:
            v = slot.pop(m, None)
            if v is None:
                raise PipelineError(f"no {what} for microbatch {m}: not received or handed over")
            if type(v) is Posted:
                return wait(v)
            return v

        return take

    # -- communication -----------------------------------------------------------------------
    def _recv_target(self, a: Action) -> tuple[Callable[[], tuple[TensorMeta, ...]], dict, int]:
        """A RECV's buffer metadata (read when it runs: shapes are inferred at the first
        step), the slot its Posted entry goes to, and the peer it receives from."""
        st = self.stages[a.stage]
        if a.kind is Kind.RECV_F:
            return (lambda: st.in_meta), st.fwd_in, self.placement[a.stage - 1]
        return (lambda: st.float_out_meta), st.grad_out, self.placement[a.stage + 1]

    def _compile_recv(self, a: Action) -> Callable[[], None]:
        bundle = self._bundle_of.get(a)
        if bundle is not None:
            return self._bundle_receiver(bundle) if bundle[0] == a else _nothing
        return self._receiver(a, *self._recv_target(a))

    def _compile_send(self, a: Action) -> Callable[[], None]:
        values = self._send_values(a)
        bundle = self._bundle_of.get(a)
        if bundle is None:
            post = self._sender(self._send_peer(a))
            return lambda: post(values())
        pending = self._pending.setdefault(bundle, [])
        if bundle[-1] != a:
            return lambda: pending.extend(values())
        post, device = self._sender(self._send_peer(a)), self.device

        def send_bundle() -> None:
            pending.extend(values())
            packed = pack(pending, device)
            pending.clear()
            post((packed,))

        return send_bundle

    def _send_peer(self, a: Action) -> int:
        return self.placement[a.stage + (1 if a.kind is Kind.SEND_F else -1)]

    def _send_values(self, a: Action) -> Callable[[], tuple]:
        """What a SEND ships: F's stashed outputs, or B/I's input gradients (zeros where
        autograd produced none)."""
        st, m = self.stages[a.stage], a.microbatch
        if a.kind is Kind.SEND_F:
            return partial(st.sent_values, m)
        device = self.device

        def input_gradients() -> tuple:
            grads = st.grad_in.pop(m, None)
            if grads is None:
                raise PipelineError(f"no input gradient of microbatch {m} to send")
            return tuple(
                g.contiguous() if g is not None else torch.zeros(shape, dtype=dt, device=device)
                for g, (shape, dt) in zip(grads, st.float_in_meta, strict=True)
            )

        return input_gradients

    def _receiver(
        self, a: Action, metas: Callable[[], tuple[TensorMeta, ...]], slot: dict, peer: int
    ) -> Callable[[], None]:
        """Posts a receive from ``peer`` into fresh buffers and leaves it in ``slot``."""
        comm, device, queued, m = self.comm, self.device, self._queued, a.microbatch

        def post_recv() -> None:
            bufs = tuple(torch.empty(shape, dtype=dt, device=device) for shape, dt in metas())
            posted = Posted(bufs, a)
            for b in bufs:
                comm.queue_recv(b, peer)
                queued.append(posted)
            slot[m] = posted

        return post_recv

    def _bundle_receiver(self, bundle: tuple[Action, ...]) -> Callable[[], None]:
        """Posts one receive for a bundle's messages into one packed buffer; each RECV's
        Posted entry holds its views of it and shares the one work."""
        comm, device, queued = self.comm, self.device, self._queued
        targets = [(a, *self._recv_target(a)) for a in bundle]
        peer = targets[0][3]

        def recv_bundle() -> None:
            metas = [m() for _, m, _, _ in targets]
            packed, views = packed_buffer([t for ms in metas for t in ms], device)
            works: list = []
            k = 0
            for (a, _, slot, _), ms in zip(targets, metas, strict=True):
                slot[a.microbatch] = Posted(tuple(views[k : k + len(ms)]), a, works)
                k += len(ms)
            comm.queue_recv(packed, peer)
            queued.append(_BundleReceive(works))

        return recv_bundle

    def _sender(self, peer: int) -> Callable[[tuple], None]:
        """Queues tensors to send to ``peer``."""
        comm, queued, prune = self.comm, self._queued, self._prune_sends

        def post_send(tensors: tuple) -> None:
            prune()
            for t in tensors:
                comm.queue_send(t, peer)
                queued.append(t)

        return post_send


def _nothing() -> None:
    """A bundled RECV after the first: the bundle's receive was posted by the first."""


# What each compute kind compiles to, as steps (it may be an overlap's part).
_PHASES: dict[Kind, Callable[[Executor, Action], Phases]] = {
    Kind.F: Executor._forward_phases,
    Kind.B: Executor._backward_phases,
    Kind.I: Executor._backward_input_phases,
    Kind.W: Executor._backward_weight_phases,
}

# What each action kind compiles to: one closure.
_HANDLERS: dict[Kind, Callable[[Executor, Action], Callable[[], None]]] = {
    **dict.fromkeys(_PHASES, Executor._compile_plain),
    Kind.OVERLAP_F_B: Executor._compile_overlap,
    Kind.RECV_F: Executor._compile_recv,
    Kind.RECV_B: Executor._compile_recv,
    Kind.SEND_F: Executor._compile_send,
    Kind.SEND_B: Executor._compile_send,
}
