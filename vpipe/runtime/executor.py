"""Runs one rank's lowered program for one step.

The program is compiled once into a list of closures, one per action, with every lookup that
does not depend on the step (stage objects, peers, where a result goes) bound in advance; the
step loop only calls them. Results move between actions through the stages' per-microbatch
dicts:

- F(s) on a rank that also holds s+1 puts its output, detached, straight into stage s+1's
  ``fwd_in`` (local handoff: no copy, no communication); otherwise SEND_F ships it.
- B/I(s+1) on a rank that also holds s puts its input gradient straight into stage s's
  ``grad_out``; otherwise it waits in ``grad_in`` for SEND_B.
- RECV_F/RECV_B post receives into fresh buffers where the program puts them and leave a
  ``Posted`` entry; the consuming compute waits on it just before it runs (span
  ``PP:WAIT:{recv action}``). Adjacent communication actions are posted as one batch. Sends are
  completed by the end of the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import record_function

from vpipe.errors import PipelineError, one_line
from vpipe.ir import Action, Kind
from vpipe.runtime.comm import P2P
from vpipe.runtime.meta import TensorMeta
from vpipe.runtime.stage import Stage

__all__ = ["Executor"]


class Posted:
    """A posted receive: its buffers, its works, and the action that posted it."""

    __slots__ = ("bufs", "works", "action")

    def __init__(self, bufs: tuple[torch.Tensor, ...], action: Action) -> None:
        self.bufs = bufs
        self.works: list = []
        self.action = action


class _PartFailed(Exception):
    """An overlap action's part failed (carries which part)."""

    def __init__(self, part: Action, error: BaseException) -> None:
        super().__init__(part, error)
        self.part, self.error = part, error


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
    ) -> None:
        self.rank = rank
        self.stages = stages
        self.placement = placement
        self.n_stages = len(placement)
        self.comm = comm
        self.device = device
        self.profiling = False
        self._inputs: list[tuple[torch.Tensor, ...]] = []
        self._targets: list[Any] = []
        self._losses: list[torch.Tensor | None] = []
        self._queued: list[
            Posted | torch.Tensor
        ] = []  # per queued op: its receive, or the sent tensor
        self._sends: deque[tuple[list, list[torch.Tensor]]] = deque()  # works, tensors sent
        self.live = self.live_bytes = self.peak_live = self.peak_live_bytes = 0
        self._program = [(a, f"PP:{a}", self._compile(program, i)) for i, a in enumerate(program)]

    # -- running -----------------------------------------------------------------------------
    def run(
        self, inputs: list[tuple[torch.Tensor, ...]], targets: list[Any], n_microbatches: int
    ) -> list[torch.Tensor] | None:
        """Execute the program once; return the per-microbatch losses on the loss rank."""
        self._inputs, self._targets = inputs, targets
        self._losses = [None] * n_microbatches
        self.peak_live, self.peak_live_bytes = self.live, self.live_bytes
        action = None
        try:
            if self.profiling:
                for action, label, fn in self._program:  # noqa: B007 (named on failure)
                    with record_function(label):
                        fn()
            else:
                for action, _, fn in self._program:  # noqa: B007 (named on failure)
                    fn()
            self._finish_sends()
        except Exception as e:
            raise self._describe(action, e) from e
        finally:
            self._inputs, self._targets = [], []
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
        self.live = self.live_bytes = 0
        if self.comm is not None:
            self.comm.discard()

    def _describe(self, action: Action | None, e: Exception) -> PipelineError:
        where = f"rank {self.rank}"
        if action is None:
            return PipelineError(f"{where}: {one_line(e)}")
        shown, part = str(action), action
        if isinstance(e, _PartFailed):
            part, e = e.part, e.error
            shown = f"{part} in {action}"
        detail = ""
        if isinstance(e, _WaitFailed):
            src = self.placement.get(e.action.stage + (-1 if e.action.kind is Kind.RECV_F else 1))
            detail = f"waiting for {e.action} from rank {src}: "
            e = e.error
        text = str(e) if isinstance(e, PipelineError) else one_line(e)
        return PipelineError(
            f"{where}: action {shown} (stage {part.stage}, microbatch {part.microbatch}) "
            f"failed: {detail}{text}"
        )

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
        return posted.bufs

    def _flush(self) -> None:
        # A coalesced batch gives all its operations one works list: a receive takes it once,
        # and its sends share one entry.
        works = self.comm.flush()
        sends = self._sends
        posted = posted_works = None  # the receive last given works, and those works
        for owner, w in zip(self._queued, works, strict=True):
            if type(owner) is Posted:
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

    def _add_live(self, st: Stage, sign: int) -> None:
        self.live += sign
        self.live_bytes += sign * (st.act_bytes or 0)
        if self.live > self.peak_live:
            self.peak_live = self.live
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes

    # -- compilation -------------------------------------------------------------------------
    def _compile(self, program: list[Action], i: int) -> Callable[[], None]:
        a = program[i]
        if a.kind is Kind.OVERLAP_F_B:
            parts = [(p, self._compile_compute(p)) for p in a.parts]

            def overlap() -> None:
                for p, fn in parts:
                    try:
                        fn()
                    except Exception as e:
                        raise _PartFailed(p, e) from e

            return overlap
        if a.is_comm:
            post = self._compile_comm(a)
            if i + 1 < len(program) and program[i + 1].is_comm:
                return post  # the next action joins this batch
            flush = self._flush

            def post_and_flush() -> None:
                post()
                flush()

            return post_and_flush
        return self._compile_compute(a)

    def _compile_compute(self, a: Action) -> Callable[[], None]:
        s, m = a.stage, a.microbatch
        st = self.stages[s]
        prev = self.stages.get(s - 1)
        nxt = self.stages.get(s + 1)
        # Where B/I put the input gradient: stage s-1 here, else SEND_B's queue; stage 0: nowhere.
        grads_to = None if s == 0 else prev.grad_out if prev is not None else st.grad_in
        kind = a.kind

        def take(d: dict, what: str) -> Any:
            v = d.pop(m, None)
            if v is None:
                raise PipelineError(f"no {what} for microbatch {m}: not received or handed over")
            if type(v) is Posted:
                return self._wait(v)
            return v

        def give_back(grads: tuple) -> None:
            if grads_to is not None:
                grads_to[m] = grads

        if kind is Kind.F:

            def forward() -> None:
                vals = self._inputs[m] if st.is_first else take(st.fwd_in, "input")
                out = st.forward(m, vals, self._targets[m] if st.is_last else None)
                if st.is_last:
                    self._losses[m] = out.detach()
                elif nxt is not None:
                    nxt.fwd_in[m] = tuple(t.detach() for t in out)
                self._add_live(st, 1)

            return forward
        if kind is Kind.B:

            def backward() -> None:
                grads = None if st.is_last else take(st.grad_out, "output gradient")
                give_back(st.backward(m, grads))
                self._add_live(st, -1)

            return backward
        if kind is Kind.I:

            def backward_input() -> None:
                grads = None if st.is_last else take(st.grad_out, "output gradient")
                give_back(st.backward_input(m, grads))

            return backward_input

        def backward_weight() -> None:
            if m not in st.weight:
                raise PipelineError(f"W before I for microbatch {m}")
            st.backward_weight(m)
            self._add_live(st, -1)

        return backward_weight

    def _compile_comm(self, a: Action) -> Callable[[], None]:
        s, m, kind = a.stage, a.microbatch, a.kind
        st = self.stages[s]
        comm = self.comm
        device = self.device
        peer = (
            self.placement[s + 1] if kind in (Kind.SEND_F, Kind.RECV_B) else self.placement[s - 1]
        )
        queued = self._queued

        def post_recv(metas: tuple[TensorMeta, ...]) -> None:
            bufs = tuple(torch.empty(shape, dtype=dt, device=device) for shape, dt in metas)
            posted = Posted(bufs, a)
            for b in bufs:
                comm.queue_recv(b, peer)
                queued.append(posted)
            (st.fwd_in if kind is Kind.RECV_F else st.grad_out)[m] = posted

        def post_send(tensors: tuple) -> None:
            self._prune_sends()
            for t in tensors:
                comm.queue_send(t, peer)
                queued.append(t)

        if kind is Kind.RECV_F:

            def recv_f() -> None:
                post_recv(st.in_meta)

            return recv_f
        if kind is Kind.RECV_B:

            def recv_b() -> None:
                post_recv(st.float_out_meta)

            return recv_b
        if kind is Kind.SEND_F:

            def send_f() -> None:
                post_send(st.sent_values(m))

            return send_f

        def send_b() -> None:
            grads = st.grad_in.pop(m, None)
            if grads is None:
                raise PipelineError(f"no input gradient of microbatch {m} to send")
            post_send(
                tuple(
                    g.contiguous() if g is not None else torch.zeros(shape, dtype=dt, device=device)
                    for g, (shape, dt) in zip(grads, st.float_in_meta, strict=True)
                )
            )

        return send_b
