"""Several messages as one: packing tensors into one byte buffer (a bundle's send), views of
such a buffer (its receive), and a work that several receives wait for (see
:mod:`vpipe.ir.bundling`)."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["WaitOnce", "pack", "packed_buffer"]

_ALIGN = 16  # bytes: every packed tensor starts at a multiple, so any dtype can view it


def _layout(metas: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for shape, dt in metas:
        offsets.append(end)
        n = math.prod(shape) * dt.itemsize
        end += -(-n // _ALIGN) * _ALIGN
    return offsets, end


def packed_buffer(
    metas: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A byte buffer for tensors of ``metas`` laid out one after another, and a view of each."""
    offsets, total = _layout(metas)
    packed = torch.empty(total, dtype=torch.uint8, device=device)
    views = [
        packed[off:].view(dt)[: math.prod(shape)].view(shape).detach()
        for off, (shape, dt) in zip(offsets, metas, strict=True)
    ]
    return packed, views


def pack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors copied into one byte buffer laid out as :func:`packed_buffer` reads it."""
    packed, views = packed_buffer([(tuple(t.shape), t.dtype) for t in tensors], device)
    for v, t in zip(views, tensors, strict=True):
        v.copy_(t)
    return packed


class WaitOnce:
    """A work that several entries wait for: a gloo work's ``wait`` consumes its completion,
    so a second ``wait`` on it would block."""

    __slots__ = ("work", "done")

    def __init__(self, work: Any) -> None:
        self.work, self.done = work, False

    def wait(self) -> bool:
        if not self.done:
            self.work.wait()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()
