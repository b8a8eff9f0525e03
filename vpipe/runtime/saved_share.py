"""What a stage's input gradient (I) frees of the activations its forward saved, measured.

:func:`saved_around_i` runs one microbatch of a stage through F, then I and W as the runtime
splits them (:mod:`vpipe.runtime.backward`), and counts the bytes autograd holds for backward
after each: what F saved (each storage once, parameters excluded), what is still alive after
I (saved tensors not yet released, and the output gradients I recorded for W), and after W.
The share I frees is ``1 - after_i / after_f`` (0 when I frees nothing or holds more), the
figure a memory model with ``--i-frees`` takes (:mod:`vpipe.sim.arch` predicts it from the
model's shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from vpipe.runtime.backward import backward_input, grad_node

__all__ = ["SavedAroundI", "saved_around_i"]


@dataclass(frozen=True)
class SavedAroundI:
    """Bytes held for backward after F, after I and after W of one microbatch."""

    after_f: int
    after_i: int
    after_w: int

    @property
    def i_frees(self) -> float:
        """The share of F's saved bytes that I frees (0 when it frees none on balance)."""
        return max(0.0, 1.0 - self.after_i / self.after_f) if self.after_f else 0.0


class _Live:
    """Bytes of the saved storages alive (each storage counted once)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.refs: dict[int, list[int]] = {}

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.refs.values())

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in self.exclude:
            return t
        return _Held(self, t, key, storage.nbytes())


class _Held:
    """A saved tensor, detached: holding the tensor itself (with its grad_fn) from inside its
    own graph is a reference cycle Python cannot collect, which keeps a retained graph's
    buffers alive after W."""

    __slots__ = ("live", "t", "key")

    def __init__(self, live: _Live, t: torch.Tensor, key: int, nbytes: int) -> None:
        self.live, self.t, self.key = live, t.detach(), key
        ref = live.refs.setdefault(key, [0, nbytes])
        ref[0] += 1

    def __del__(self) -> None:
        ref = self.live.refs[self.key]
        ref[0] -= 1
        if ref[0] == 0:
            del self.live.refs[self.key]


def saved_around_i(
    module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]
) -> SavedAroundI:
    """F of ``module`` on ``inputs`` (float tensors; they are made to require grad), I with
    output gradients ``grads``, then W; the bytes held for backward after each."""
    params = list(module.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params}
    xs = tuple(x.detach().requires_grad_(True) for x in inputs)
    exclude |= {x.untyped_storage().data_ptr() for x in xs}  # the previous stage's output
    live = _Live(exclude)
    with saved_tensors_hooks(live.pack, lambda h: h.t if isinstance(h, _Held) else h):
        out = module(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    after_f = live.bytes
    param_nodes = {grad_node(p): p for p in params}
    _, task = backward_input(list(outs), list(grads), list(xs), param_nodes)
    del out, outs
    recorded = {
        g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
        for _, gs, _ in task.parts
        for g in gs
        if g.untyped_storage().data_ptr() not in live.refs
    }
    after_i = live.bytes + sum(recorded.values())
    task.run()
    del task
    return SavedAroundI(after_f, after_i, live.bytes)
