"""Activation recomputation: what a stage keeps from its forward for its backward.

Modes (:data:`RECOMPUTE_MODES`):

- ``none``: F saves what autograd saves; backward uses it.
- ``full``: F runs without autograd and keeps only the stage's inputs (and the RNG state);
  the stage's backward (B, or I under a split backward) first runs the forward again from
  them, with autograd, then backpropagates through that graph. W uses the graph I recomputed,
  so the recomputation runs once per microbatch and stage, and what W needs of it is held
  from I until W.
- ``selective``: F runs with autograd, but what the model marks is not kept: :func:`recomputed`
  runs a parameter-free function (attention's core) whose saved tensors are dropped and
  recomputed from its inputs when backward reaches it; :func:`lazy` marks an output that
  autograd would save (an activation function's output, saved by the next linear layer) as
  recomputed from its input the first time backward needs it, then held until the last use
  (W). Matrix products' outputs stay saved: cheap to keep, costly to recompute (Korthikanti
  et al. 2022). A model that marks nothing keeps everything, as with ``none``.

The markers act only inside a stage's selective forward (:class:`Selective`); elsewhere they
are plain calls, so a model uses them unconditionally. While the profiler records, each marked
call sits in a ``PP:RECOMPUTABLE`` span (:data:`RECOMPUTABLE_SPAN`) in any mode: the share of
a forward those spans take, read from a run without recomputation, is what selective
recomputation would rerun (:func:`vpipe.predict.recompute_share.selective_shares`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from vpipe.events import RECOMPUTABLE

__all__ = [
    "RECOMPUTABLE_SPAN",
    "RECOMPUTE_MODES",
    "Selective",
    "check_mode",
    "lazy",
    "recomputed",
    "rng_state",
]

RECOMPUTE_MODES = ("none", "full", "selective")
RECOMPUTABLE_SPAN = f"PP:{RECOMPUTABLE}"  # a marked call, while profiling

_active: list[Selective] = []  # the selective forward running now (innermost last)


def check_mode(mode: str, what: str = "recompute") -> str:
    """``mode`` if it is a recompute mode, else ValueError naming ``what`` and the modes."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"{what} must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    return mode


def rng_state(device: torch.device) -> Callable[[], None]:
    """A snapshot of ``device``'s RNG: calling it restores that state (full recompute replays
    the forward's random draws, e.g. dropout's)."""
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
        return lambda: torch.cuda.set_rng_state(state, device)
    state = torch.get_rng_state()
    return lambda: torch.set_rng_state(state)


def recomputed(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)``; in a selective forward, nothing ``fn`` saves is kept: backward runs it
    again from ``inputs``. ``fn`` must have no parameters (attention's core)."""
    with _span():
        if not _active or not torch.is_grad_enabled():
            return fn(*inputs)
        return _Recomputed.apply(fn, *inputs)


def lazy(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)``; in a selective forward, where autograd saves the result (or a view of it)
    for backward it keeps ``x`` instead and recomputes ``fn(x)`` the first time backward
    needs it. ``fn`` must be cheap and deterministic (an activation function)."""
    with _span():
        y = fn(x)
    if _active and torch.is_grad_enabled():
        _active[-1].register(y, fn, x)
    return y


def _span() -> Any:
    """A ``PP:RECOMPUTABLE`` profiler span while the profiler records, else nothing."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(RECOMPUTABLE_SPAN)
    return nullcontext()


class Selective:
    """One selective forward: ``with sel:`` around it, under ``saved_tensors_hooks(sel.pack,
    sel.unpack)``, made just before them: hooks already in force (a memory meter's) still
    see every tensor kept. ``lazy_bytes`` is what the :func:`lazy` outputs it dropped would
    have held (recomputed in backward and held until W)."""

    def __init__(self) -> None:
        self._marked: dict[int, _Entry] = {}
        self.lazy_bytes = 0
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def __enter__(self) -> Selective:
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)
        self._marked.clear()

    def register(self, y: torch.Tensor, fn: Callable, x: torch.Tensor) -> None:
        storage = y.untyped_storage()
        self._marked[storage.data_ptr()] = _Entry(y, fn, x, storage.nbytes())

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a marked output becomes a recipe, anything else stays."""
        entry = self._marked.get(t.untyped_storage().data_ptr()) if self._marked else None
        if entry is None or entry.out() is None:  # unmarked, or a reused address
            return t if self._outer is None else _Outer(self._outer, t)
        if not entry.counted:
            entry.counted = True
            self.lazy_bytes += entry.nbytes
        return _Lazy(entry, t)

    @staticmethod
    def dropped(h: Any) -> bool:
        """Whether what :meth:`pack` returned stands for a tensor it did not keep."""
        return type(h) is _Lazy

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.get() if type(h) in (_Lazy, _Outer) else h


class _Outer:
    """A kept tensor packed by the hooks that were in force before the selective ones."""

    __slots__ = ("unpack", "packed")

    def __init__(self, outer: tuple[Callable, Callable], t: torch.Tensor) -> None:
        self.unpack, self.packed = outer[1], outer[0](t)

    def get(self) -> torch.Tensor:
        return self.unpack(self.packed)


class _Entry:
    """A marked output: how to recompute it, and its value once recomputed (shared by every
    saved view of it, so it is recomputed once)."""

    __slots__ = ("out", "fn", "x", "nbytes", "value", "counted")

    def __init__(self, y: torch.Tensor, fn: Callable, x: torch.Tensor, nbytes: int) -> None:
        self.out = weakref.ref(y)  # dead once the forward dropped it: its address is reused
        self.fn, self.x, self.nbytes = fn, x.detach(), nbytes
        self.value: torch.Tensor | None = None
        self.counted = False

    def get(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.fn(self.x)
        return self.value


class _Lazy:
    """A saved view of a marked output, kept as its geometry."""

    __slots__ = ("entry", "geometry")

    def __init__(self, entry: _Entry, t: torch.Tensor) -> None:
        self.entry = entry
        self.geometry = (t.shape, t.stride(), t.storage_offset())

    def get(self) -> torch.Tensor:
        return self.entry.get().as_strided(*self.geometry)


class _Recomputed(torch.autograd.Function):
    """Forward without saving ``fn``'s internals; backward recomputes them from the inputs."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        xs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*xs)
        need = [x for x in xs if x.requires_grad]
        got = iter(torch.autograd.grad(out, need, grad, allow_unused=True))
        return (None, *(next(got) if x.requires_grad else None for x in xs))
