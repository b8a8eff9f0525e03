"""Your own model in vpipe: two ways to hand it over.

Run from the repository root (the module must be importable on every rank)::

    PYTHONPATH=examples vpipe run zbv -p 2 -m 4 --batch 16 --model custom_model:blocks --check
    PYTHONPATH=examples vpipe run 1f1b -p 2 -m 4 --batch 16 --model custom_model:named --check
    PYTHONPATH=examples vpipe bench --model custom_model:blocks --sizes width=128 --out out/custom

``blocks`` returns the model as an ordered list of blocks; vpipe splits it into contiguous
stages. ``named`` returns a whole model and, per stage, the names of the submodules that stage
runs (torchtitan's ``module_fqns_per_model_part`` style), here chosen for any stage count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vpipe.models import ModelParts


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _batch_maker(width: int):
    def make_batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)

    return make_batch


def blocks(width: int = 64, depth: int = 8) -> ModelParts:
    """A stack of ``depth`` residual blocks, split contiguously by vpipe."""
    return ModelParts(
        loss_fn=F.mse_loss,
        make_batch=_batch_maker(width),
        blocks=[Block(width) for _ in range(depth)],
    )


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, width)


def named(width: int = 64, depth: int = 8) -> ModelParts:
    """A whole model plus module names per stage: layers shared out evenly, head on the last."""
    net = Net(width, depth)

    def stage_fqns(n_stages: int) -> list[list[str]]:
        per = [[] for _ in range(n_stages)]
        for i in range(depth):
            per[i * n_stages // depth].append(f"layers.{i}")
        per[-1].append("head")
        return per

    return ModelParts(
        loss_fn=F.mse_loss, make_batch=_batch_maker(width), model=net, stage_fqns=stage_fqns
    )
