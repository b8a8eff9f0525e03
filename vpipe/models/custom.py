"""Bring your own model: ``--model package.module:function`` for ``vpipe run`` and ``vpipe bench``.

The function takes the model's sizes as keyword arguments (``--sizes d_model=512,...``, all
optional) and returns :class:`ModelParts`: the model as an ordered list of blocks (split into
contiguous stages the way the built-in models are), or a whole model plus the module names
each stage runs (torchtitan's ``module_fqns_per_model_part`` style), with its loss and a batch
maker. vpipe seeds torch's RNG before calling it, so every stage split gets the same
parameters and the unsplit reference (``--check``) is the stages run in order.

The module must be importable on every rank: on ``PYTHONPATH`` or installed (the working
directory counts under ``python -m vpipe`` and ``torchrun -m vpipe``, not for the ``vpipe``
script). ``examples/custom_model.py`` shows both styles.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vpipe.models.base import BenchModel, ModelError, Stage, split_pieces

StageNames = Sequence[Sequence[str]] | Callable[[int], Sequence[Sequence[str]]]


@dataclass
class ModelParts:
    """What a user's model function returns.

    Give ``blocks`` (the model's pieces in order) or ``model`` with ``stage_fqns`` (per stage,
    the dotted names of the submodules it runs, in order; or a function of the stage count
    returning them). ``loss_fn(output, target)`` is mean-reduced over the batch;
    ``make_batch(batch, seed)`` returns deterministic ``(inputs, targets)``; set
    ``tokens_per_sample`` for token models (tokens/s).
    """

    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    make_batch: Callable[[int, int], tuple[Any, torch.Tensor]]
    blocks: Sequence[nn.Module] | None = None
    model: nn.Module | None = None
    stage_fqns: StageNames | None = None
    tokens_per_sample: int | None = None


def load_function(name: str) -> Callable[..., ModelParts]:
    """The model function ``name`` (``package.module:function``) refers to."""
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ModelError(f"--model {name!r}: expected package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own error at import
        raise ModelError(
            f"--model {name!r}: cannot import {module_name!r}: {type(e).__name__}: {e}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelError(f"--model {name!r}: {module_name} has no function {attr!r}")
    return fn


def build_custom(name: str, n_stages: int, seed: int, sizes: Mapping[str, int]) -> BenchModel:
    """Call the user's model function (seeded) and split its model into ``n_stages``."""
    fn = load_function(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            parts = fn(**sizes)
        except TypeError as e:
            raise ModelError(f"--model {name!r}: calling it with sizes {dict(sizes)}: {e}") from None
    if not isinstance(parts, ModelParts):
        raise ModelError(
            f"--model {name!r} returned {type(parts).__name__}, not vpipe.models.custom.ModelParts"
        )
    if (parts.blocks is None) == (parts.model is None):
        raise ModelError(f"--model {name!r}: give either blocks or model with stage_fqns")
    if parts.blocks is not None:
        stages = split_pieces(list(parts.blocks), n_stages, f"blocks of {name}")
    else:
        stages = _stages_by_name(name, parts, n_stages)

    def batch_fn(batch: int, batch_seed: int) -> tuple[Any, torch.Tensor]:
        return parts.make_batch(batch, batch_seed)

    return BenchModel(
        name, stages, parts.loss_fn, dict(sizes), seed, batch_fn, parts.tokens_per_sample
    )


def _stages_by_name(name: str, parts: ModelParts, n_stages: int) -> list[nn.Module]:
    """Stages from module names per stage; every parameter must land in exactly one stage."""
    model, names = parts.model, parts.stage_fqns
    if names is None:
        raise ModelError(f"--model {name!r}: a whole model needs stage_fqns")
    per_stage = [list(x) for x in (names(n_stages) if callable(names) else names)]
    if len(per_stage) != n_stages:
        raise ModelError(
            f"--model {name!r}: stage_fqns names {len(per_stage)} stages, the schedule has "
            f"{n_stages}"
        )
    owner: dict[str, int] = {}
    stages = []
    for i, fqns in enumerate(per_stage):
        if not fqns:
            raise ModelError(f"--model {name!r}: stage {i} runs no module")
        mods = []
        for fqn in fqns:
            if fqn in owner:
                raise ModelError(f"--model {name!r}: module {fqn!r} in stages {owner[fqn]} and {i}")
            owner[fqn] = i
            try:
                mods.append(model.get_submodule(fqn))
            except AttributeError:
                raise ModelError(f"--model {name!r}: the model has no module {fqn!r}") from None
        stages.append(Stage(mods))
    covered = {id(p) for st in stages for p in st.parameters()}
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise ModelError(
            f"--model {name!r}: stage_fqns leave {len(missing)} parameters in no stage, "
            f"e.g. {missing[0]!r}"
        )
    return stages
