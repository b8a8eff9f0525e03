"""Point-to-point communication between pipeline ranks over torch.distributed.

Operations are queued and posted together (``flush``): on backends that coalesce (NCCL) as one
``batch_isend_irecv``; elsewhere (gloo) each is posted straight on the process group, which is
what batching does there anyway, minus its per-op bookkeeping.

gloo sends and receives host memory only, so with GPU tensors on gloo (ranks sharing one GPU)
each operation goes through a host copy: a send copies its tensor to the host when queued, a
receive lands in a host buffer that its work copies into the device tensor on ``wait``.

**Channels.** NCCL runs a process group's point-to-point operations on one stream per rank, in
posting order (batched ones on the group's communicator). A receive posted early then holds up
every later send of that rank until its data arrives, and a program that is deadlock-free
under vpipe's semantics (:mod:`vpipe.ir.engine`: posted operations progress independently) can
hang: with receives posted one action ahead, that happens for every built-in family. With
``channels`` (the default on NCCL) each direction between two ranks gets its own process group,
hence its own stream, and every operation is posted on its own: a channel carries messages one
way, in the order both ends post them, which is the engine's per-peer FIFO rule, so the
engine's deadlock check covers it.

**The poster thread.** Posting a gloo operation from the compute thread costs 0.2-1 ms on a
busy host: a receive takes its pair's lock, which gloo's I/O thread holds while it reads an
incoming payload, and a send may write its payload itself. With ``post_thread`` (the default on
gloo) one daemon thread per process posts each flushed batch, in flush order, and the compute
thread goes on; waiting on an operation first waits for its batch to be posted. The order in
which a rank posts is unchanged, so the engine's semantics and its deadlock check still hold.
NCCL posts asynchronously already (a kernel enqueued on a stream), so the thread is gloo's only.

**Connecting.** NCCL creates a communicator on a group's first operation, and that creation
blocks the host until both ends arrive: the first message on each channel would be a
rendezvous that the replay engine does not model, paid by the first timed step.
:meth:`P2P.connect` makes one tiny exchange per channel, both directions of each pair, in one
global order of pairs (so no two ranks wait on each other), and keeps its cost in
``connect_s``; the pipeline does it once when it is built.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["P2P", "poster_thread_ids", "uses_post_thread"]


def uses_post_thread(backend: str, post_thread: bool | None) -> bool:
    """Whether P2P on ``backend`` posts from the poster thread: as ``post_thread`` says, by
    default on gloo; ValueError when it asks for the thread on another backend."""
    if post_thread and backend != "gloo":
        raise ValueError(
            f"post_thread is for gloo; the {backend} backend posts asynchronously already"
        )
    return backend == "gloo" if post_thread is None else post_thread


class P2P:
    """Asynchronous sends and receives to group ranks of one process group.

    ``pairs`` are the pairs of group ranks that exchange messages in the whole program (the
    same list on every rank); ``channels`` (None: on NCCL) posts each direction of each pair on
    its own process group. Creating them is collective over the default group: every rank of it
    must build its P2P at the same point. ``post_thread`` (None: on gloo; gloo only) posts
    flushed operations from the process's poster thread. See the module docstring for both.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        pairs: Iterable[tuple[int, int]] = (),
        channels: bool | None = None,
        post_thread: bool | None = None,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        backend = self.group._get_backend(device)
        gloo = backend.name() == "gloo"
        posts_from_thread = uses_post_thread(backend.name(), post_thread)
        self.channels = backend.name() == "nccl" if channels is None else channels
        self.coalesce = bool(getattr(backend, "supports_coalescing", False)) and not self.channels
        self.via_host = device.type != "cpu" and gloo
        self._queue: list[tuple[bool, torch.Tensor, int]] = []
        self.device = device
        self.pairs = sorted({tuple(sorted(p)) for p in pairs})
        self.connect_s: float | None = None  # what connect() cost, once it ran
        self._routes = _channel_routes(self.group, pairs) if self.channels else {}
        self._poster = _poster() if posts_from_thread else None

    def queue_send(self, tensor: torch.Tensor, peer: int) -> None:
        self._queue.append((True, tensor.cpu() if self.via_host else tensor, peer))

    def queue_recv(self, tensor: torch.Tensor, peer: int) -> None:
        self._queue.append((False, tensor, peer))

    def flush(self) -> list[list]:
        """Post every queued operation; return, per operation in queue order, the works to
        wait for it (a coalesced batch shares its works)."""
        ops, self._queue = self._queue, []
        if self.coalesce and len(ops) > 1:
            p2p = [
                dist.P2POp(dist.isend if s else dist.irecv, t, group=self.group, group_peer=p)
                for s, t, p in ops
            ]
            works = dist.batch_isend_irecv(p2p)
            return [works] * len(ops)
        if self._poster is not None:
            batch = self._poster.submit(self._post_each, ops)
            return [[_PostedLater(batch, i)] for i in range(len(ops))]
        return [[w] for w in self._post_each(ops)]

    def _post_each(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list[Any]:
        return [self._send(t, p) if s else self._recv(t, p) for s, t, p in ops]

    def _route(self, send: bool, peer: int) -> tuple[Any, int]:
        """The process group to post on and the peer's rank in it: its channel, or the group."""
        return self._routes.get((send, peer)) or (self.group, peer)

    def _send(self, tensor: torch.Tensor, peer: int) -> Any:
        group, rank = self._route(True, peer)
        return group.send([tensor], rank, 0)

    def _recv(self, tensor: torch.Tensor, peer: int) -> Any:
        group, rank = self._route(False, peer)
        if not self.via_host:
            return group.recv([tensor], rank, 0)
        host = torch.empty_like(tensor, device="cpu")
        return _CopyOnWait(group.recv([host], rank, 0), host, tensor)

    def connect(self) -> float:
        """Exchange one tiny message each way with every peer, on the channels (module
        docstring), and synchronise the device: every communicator exists afterwards. Returns
        the seconds it took (also in ``connect_s``)."""
        t0 = time.perf_counter()
        me = dist.get_rank(self.group)
        for a, b in self.pairs:  # one global order: the lowest pending pair can always proceed
            if me not in (a, b):
                continue
            peer = b if a == me else a
            one = torch.zeros(1, device=self.device)
            for send in (me < peer, me > peer):  # the lower rank sends first
                if send:
                    self.send_now(one, peer)
                else:
                    self.recv_now(one, peer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.connect_s = time.perf_counter() - t0
        return self.connect_s

    def discard(self) -> None:
        """Drop queued, unposted operations (after a failed step)."""
        self._queue.clear()

    def send_now(self, tensor: torch.Tensor, peer: int) -> None:
        """Blocking send (metadata handshake)."""
        self._send(tensor.cpu() if self.via_host else tensor, peer).wait()

    def recv_now(self, tensor: torch.Tensor, peer: int) -> None:
        """Blocking receive (metadata handshake)."""
        self._recv(tensor, peer).wait()


# Channel groups by (lower global rank, higher global rank, upward), shared by every P2P of the
# process: a pipeline built many times (a sweep) creates each channel once.
_CHANNELS: dict[tuple[int, int, bool], dist.ProcessGroup] = {}


def _channel_routes(
    group: dist.ProcessGroup, pairs: Iterable[tuple[int, int]]
) -> dict[tuple[bool, int], tuple[dist.ProcessGroup, int]]:
    """Per (is a send, peer group rank): the channel group to post on and the peer's rank in it.
    Every rank of the default group learns which channels any rank needs, then all create the
    missing ones in one order (``new_group`` is collective over the default group)."""
    to_global = (
        (lambda r: r) if group is dist.group.WORLD else (lambda r: dist.get_global_rank(group, r))
    )
    wanted = sorted({tuple(sorted((to_global(a), to_global(b)))) for a, b in pairs})
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wanted)
    for lo, hi in sorted({tuple(p) for ps in everyone for p in ps}):
        for upward in (True, False):
            if (lo, hi, upward) not in _CHANNELS:
                _CHANNELS[lo, hi, upward] = dist.new_group([lo, hi])
    me = dist.get_rank(group)
    g_me = to_global(me)
    routes = {}
    for a, b in pairs:
        if me not in (a, b):
            continue
        peer = b if a == me else a
        g_peer = to_global(peer)
        lo, hi = min(g_me, g_peer), max(g_me, g_peer)
        index = 1 if g_peer > g_me else 0  # new_group orders its ranks
        routes[True, peer] = (_CHANNELS[lo, hi, g_me < g_peer], index)
        routes[False, peer] = (_CHANNELS[lo, hi, g_peer < g_me], index)
    return routes


class _Batch:
    """Operations handed to the poster thread. ``posted`` is held until all are posted (a
    lock, not an Event: cheaper to make, and one per flush)."""

    __slots__ = ("fn", "ops", "works", "error", "posted", "done")

    def __init__(self, fn: Callable[[list], list], ops: list) -> None:
        self.fn, self.ops = fn, ops
        self.works: list[Any] = []
        self.error: BaseException | None = None
        self.posted = threading.Lock()
        self.posted.acquire()
        self.done = False

    def wait_posted(self) -> None:
        if not self.done:
            with self.posted:  # released by the poster thread
                pass
        if self.error is not None:
            raise self.error


class _PostedLater:
    """One operation of a batch the poster thread posts: waits for the posting, then the work."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: _Batch, index: int) -> None:
        self.batch, self.index = batch, index

    def wait(self) -> bool:
        b = self.batch
        b.wait_posted()
        return b.works[self.index].wait()

    def is_completed(self) -> bool:
        b = self.batch
        return b.done and (b.error is not None or b.works[self.index].is_completed())


class _Poster:
    """A daemon thread posting batches in submission order, off the compute thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="vpipe-p2p-poster", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[list], list], ops: list) -> _Batch:
        batch = _Batch(fn, ops)
        self._queue.put(batch)
        return batch

    def _loop(self) -> None:
        while True:
            b = self._queue.get()
            try:
                b.works = b.fn(b.ops)
            except BaseException as e:  # noqa: BLE001 (handed to the waiter)
                b.error = e
            b.fn = b.ops = None
            b.done = True
            b.posted.release()
            del b


_POSTER: list[_Poster] = []  # the process's poster, started by the first P2P that wants one
os.register_at_fork(after_in_child=_POSTER.clear)  # a forked child has no such thread


def poster_thread_ids() -> tuple[int, ...]:
    """The OS thread id of this process's poster thread, if it has one (for
    :func:`vpipe.trace.thread_cpu.comm_thread_ns`)."""
    return tuple(p.thread.native_id for p in _POSTER if p.thread.native_id is not None)


def _poster() -> _Poster:
    if not _POSTER:
        _POSTER.append(_Poster())
    return _POSTER[0]


class _CopyOnWait:
    """A receive's work into a host buffer; ``wait`` also copies the buffer to the device."""

    __slots__ = ("work", "host", "dst")

    def __init__(self, work: Any, host: torch.Tensor, dst: torch.Tensor) -> None:
        self.work, self.host, self.dst = work, host, dst

    def wait(self) -> bool:
        self.work.wait()
        if self.host is not None:
            self.dst.copy_(self.host)
            self.host = None
        return True

    def is_completed(self) -> bool:
        """Whether the data is here (in the host buffer): ``wait`` then only copies it over,
        so a probe (``Part.ready()``) says yes before anyone waited."""
        return self.host is None or self.work.is_completed()
