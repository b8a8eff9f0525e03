"""Baselines: the same modules and configuration run through other pipeline runtimes.

``TorchPipeline`` runs torch.distributed.pipelining's schedule class of the same name with the
``vpipe.runtime.Pipeline`` call shape, so benchmarks treat both alike. Imports are lazy so that
``vpipe.baselines`` itself does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "TorchPipeline": "vpipe.baselines.torch_pp",
    "TORCH_SCHEDULES": "vpipe.baselines.torch_pp",
    "torch_placement": "vpipe.baselines.torch_pp",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vpipe.baselines' has no attribute {name!r}")
    return getattr(import_module(module), name)
