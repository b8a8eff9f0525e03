"""Benchmark models split into pipeline stages: the shared interface (:mod:`.base`), the
built-in MLP, GPT and tuple models (:mod:`.builtin`) and the loader for yours
(:mod:`.custom`, ``--model package.module:function``). Importing this package imports torch.

A new built-in model is one builder in :mod:`.builtin` (and its default sizes there).
"""

from vpipe.models.base import BenchModel, FusedStage, ModelError, Stage, split_pieces
from vpipe.models.builtin import (
    DEFAULT_SIZES,
    OPTIONAL_SIZES,
    build_model,
    model_names,
    model_pieces,
    resolve_sizes,
)
from vpipe.models.custom import ModelParts

__all__ = [
    "DEFAULT_SIZES",
    "OPTIONAL_SIZES",
    "BenchModel",
    "FusedStage",
    "ModelError",
    "ModelParts",
    "Stage",
    "build_model",
    "model_names",
    "model_pieces",
    "resolve_sizes",
    "split_pieces",
]
