"""Point-to-point communication between pipeline ranks over torch.distributed.

Operations are queued and posted together (``flush``): on backends that coalesce (NCCL) as one
``batch_isend_irecv``; elsewhere (gloo) each is posted straight on the process group, which is
what batching does there anyway, minus its per-op bookkeeping.

gloo sends and receives host memory only, so with GPU tensors on gloo (ranks sharing one GPU)
each operation goes through a host copy: a send copies its tensor to the host when queued, a
receive lands in a host buffer that its work copies into the device tensor on ``wait``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["P2P"]


class P2P:
    """Asynchronous sends and receives to group ranks of one process group."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group if group is not None else dist.group.WORLD
        backend = self.group._get_backend(device)
        self.coalesce = bool(getattr(backend, "supports_coalescing", False))
        self.via_host = device.type != "cpu" and backend.name() == "gloo"
        self._queue: list[tuple[bool, torch.Tensor, int]] = []

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
        group = self.group
        return [[group.send([t], p, 0) if s else self._recv(t, p)] for s, t, p in ops]

    def _recv(self, tensor: torch.Tensor, peer: int) -> Any:
        if not self.via_host:
            return self.group.recv([tensor], peer, 0)
        host = torch.empty_like(tensor, device="cpu")
        return _CopyOnWait(self.group.recv([host], peer, 0), host, tensor)

    def discard(self) -> None:
        """Drop queued, unposted operations (after a failed step)."""
        self._queue.clear()

    def send_now(self, tensor: torch.Tensor, peer: int) -> None:
        """Blocking send (metadata handshake)."""
        self.group.send([tensor.cpu() if self.via_host else tensor], peer, 0).wait()

    def recv_now(self, tensor: torch.Tensor, peer: int) -> None:
        """Blocking receive (metadata handshake)."""
        self._recv(tensor, peer).wait()


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
        return self.work.is_completed() and self.host is None
