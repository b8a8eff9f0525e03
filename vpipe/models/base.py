"""The interface every benchmark model shares, built-in or yours: a model split into stages
(:class:`BenchModel`), the stage module that runs its pieces in order, and the contiguous split
of pieces into stages. :mod:`vpipe.models.builtin` and :mod:`vpipe.models.custom` both build on
this module and not on each other."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vpipe.errors import VpipeError


class ModelError(VpipeError, ValueError):
    """An unknown model name or sizes that cannot be split as asked."""



@dataclass
class BenchModel:
    """A model split into stages, with its loss, batch maker and unsplit reference.

    ``stages[i]`` is stage i's module. ``loss_fn(output, target)`` is mean-reduced over the
    batch. ``tokens_per_sample`` is set for token models (for tokens/s) and None otherwise.
    """

    name: str
    stages: list[nn.Module]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    sizes: dict[str, int]
    seed: int
    batch_fn: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    tokens_per_sample: int | None = None

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def n_params(self) -> int:
        """Total parameter count over all stages."""
        return sum(p.numel() for m in self.stages for p in m.parameters())

    def make_batch(self, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A deterministic (inputs, targets) pair of ``batch`` samples."""
        if batch < 1:
            raise ModelError(f"batch must be >= 1, got {batch}")
        return self.batch_fn(batch, seed)

    def reference_model(self) -> nn.Module:
        """The unsplit model: copies of the stages (current parameter values, no grads) run in
        order. Its parameter ``stages.{i}.{name}`` is stage i's parameter ``{name}``."""
        clones = [copy.deepcopy(m) for m in self.stages]
        for m in clones:
            for p in m.parameters():
                p.grad = None
        return Sequential(clones)



# Stage plumbing


def _unpack(inputs: tuple[Any, ...]) -> Any:
    return inputs[0] if len(inputs) == 1 else tuple(inputs)


class Stage(nn.Module):
    """One pipeline stage: runs its pieces in order; takes its input packed or unpacked."""

    def __init__(self, pieces: Sequence[nn.Module]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)

    def forward(self, *inputs: Any) -> Any:
        x = _unpack(inputs)
        for piece in self.pieces:
            x = piece(x)
        return x


class FusedStage(Stage):
    """A stage with a fused forward-backward for overlap actions (dualpipev's ``OVERLAP_F_B``):
    while the forward part's input is still being received it runs the backward part first (its
    input gradients and, for a full B, its weight gradients, none of which need that receive),
    else the forward first. Same parameters and outputs as ``Stage``."""

    def __init__(self, pieces: Sequence[nn.Module]) -> None:
        super().__init__(pieces)
        self.fused_calls = self.backward_first = 0  # how often the hook ran, and chose B first

    def overlapped_forward_backward(self, forward: Any, backward: Any) -> None:
        """Run both ``vpipe.runtime.overlap.Part`` s, backward first while the forward's input
        has not arrived."""
        self.fused_calls += 1
        first, second = (forward, backward) if forward.ready() else (backward, forward)
        self.backward_first += first is backward
        first.run()
        second.run()


class Sequential(nn.Module):
    """The unsplit reference model: the stages one after another."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, *inputs: Any) -> Any:
        x = _unpack(inputs)
        for stage in self.stages:
            x = stage(x)
        return x


def split_pieces(
    pieces: Sequence[nn.Module], n_stages: int, what: str, stage: type[Stage] = Stage
) -> list[nn.Module]:
    """Group pieces into n_stages contiguous ``stage`` modules whose sizes differ by at most one
    (earlier stages take the extra piece)."""
    n = len(pieces)
    if n < n_stages:
        raise ModelError(
            f"cannot split {n} {what} into {n_stages} stages: every stage needs at least one; "
            "use more layers/blocks or fewer stages"
        )
    base, extra = divmod(n, n_stages)
    out, start = [], 0
    for i in range(n_stages):
        size = base + (1 if i < extra else 0)
        out.append(stage(pieces[start : start + size]))
        start += size
    return out
