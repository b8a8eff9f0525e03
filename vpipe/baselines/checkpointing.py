"""torch's own activation checkpointing on a stage module, for the torch baseline's
``recompute`` modes (vpipe's runtime: :mod:`vpipe.runtime.recompute`).

``full``: the whole stage under ``torch.utils.checkpoint.checkpoint`` (non-reentrant): F keeps
the stage's inputs, backward recomputes the rest. ``selective``: the same call with torch's
selective checkpoint policy, keeping the outputs of matrix products (the linear layers') and
recomputing every other op (activation functions, norms, attention's core). torch recomputes
per backward call: under a split backward, its input and weight passes each run it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["checkpointed"]

_KEEP = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


class _Checkpointed(nn.Module):
    """``inner`` run under torch.utils.checkpoint (its parameters are ``inner``'s)."""

    def __init__(self, inner: nn.Module, selective: bool) -> None:
        super().__init__()
        self.inner = inner
        self.kw: dict[str, Any] = {"use_reentrant": False}
        if selective:
            self.kw["context_fn"] = partial(create_selective_checkpoint_contexts, _policy)

    def forward(self, *inputs: Any) -> Any:
        return checkpoint(self.inner, *inputs, **self.kw)


def checkpointed(module: nn.Module, mode: str) -> nn.Module:
    """``module`` as the torch baseline runs it under recompute ``mode``."""
    if mode == "none":
        return module
    return _Checkpointed(module, mode == "selective")
