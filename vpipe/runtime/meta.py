"""Tensor metadata (shape, dtype) of stage inputs and outputs: inference and wire encoding.

Receivers must allocate buffers before data arrives, so every rank needs the shapes of what it
receives. vpipe infers them once per microbatch input shape, in stage order: each stage's rank
runs its module once on zeros of the input shape without autograd, and hands the output
metadata to the next stage's rank as a small int64 message. Buffers (e.g. batch-norm running
statistics) and the RNG state are restored afterwards, so the probe leaves no trace. (Meta
tensors would avoid the compute, but their first use imports torch's Python decompositions,
seconds per process, more than this probe costs.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vpipe.errors import PipelineError

__all__ = ["META_LEN", "TensorMeta", "as_tuple", "decode", "encode", "infer_outputs", "meta_of"]

TensorMeta = tuple[tuple[int, ...], torch.dtype]
META_LEN = 128  # int64 words in an encoded message

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


def as_tuple(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    """A stage value as a tuple of tensors (a tensor, or a tuple/list of tensors)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise PipelineError(
        f"{what} must be a tensor or a tuple of tensors, got {type(value).__name__}"
    )


def meta_of(values: tuple[torch.Tensor, ...]) -> tuple[TensorMeta, ...]:
    return tuple((tuple(v.shape), v.dtype) for v in values)


def encode(metas: tuple[TensorMeta, ...]) -> list[int]:
    """``[n, (dtype code, ndim, dims...) * n]`` padded to META_LEN words."""
    words = [len(metas)]
    for shape, dtype in metas:
        if dtype not in _CODE:
            raise PipelineError(f"dtype {dtype} cannot be sent between stages")
        words += [_CODE[dtype], len(shape), *shape]
    if len(words) > META_LEN:
        raise PipelineError(f"stage values too complex to describe in {META_LEN} words: {metas}")
    return words + [0] * (META_LEN - len(words))


def decode(words: list[int]) -> tuple[TensorMeta, ...]:
    n, i, out = words[0], 1, []
    for _ in range(n):
        code, ndim = words[i], words[i + 1]
        out.append((tuple(words[i + 2 : i + 2 + ndim]), _DTYPES[code]))
        i += 2 + ndim
    return tuple(out)


def infer_outputs(
    module: nn.Module, inputs: tuple[TensorMeta, ...], device: torch.device, what: str
) -> tuple[TensorMeta, ...]:
    """The metadata of ``module(*inputs)``'s outputs (one forward on zeros, side effects undone)."""
    buffers = [(b, b.clone()) for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    args = tuple(torch.zeros(s, dtype=d, device=device) for s, d in inputs)
    try:
        with torch.no_grad():
            out = module(*args)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    return meta_of(as_tuple(out, what))
