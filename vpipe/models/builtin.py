"""Benchmark models split into pipeline stages: an MLP block stack, a small GPT-style decoder,
a model that passes a tuple of tensors between stages, and an MLP whose blocks each run their
weights twice (weight reuse within a stage).

Every model is built as an ordered list of *pieces* (embedding, blocks, head) from one seeded
RNG, then the pieces are grouped into contiguous stages. Parameters therefore depend only on the
seed and sizes, never on the number of stages, and the unsplit reference model is the stages run
one after another.

Stage modules accept their input either as one argument or unpacked (``stage(h, skip)`` and
``stage((h, skip))`` are the same), so any runtime convention for tuples works.

The shared stage plumbing is :mod:`vpipe.models.base`. This module imports torch; command
modules import it lazily.

Under selective recomputation (:mod:`vpipe.runtime.recompute`) the blocks keep the linear
layers' outputs and recompute the activation function's output (``lazy``: MLP, tuple and GPT
blocks) and attention's core (``recomputed``: GPT blocks) when backward needs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vpipe.models.base import BenchModel, FusedStage, ModelError, Stage, split_pieces
from vpipe.runtime.recompute import lazy, recomputed

DEFAULT_SIZES: dict[str, dict[str, int]] = {
    # The benchmark MLP: 4 blocks of 512 -> 2048 -> 512.
    "mlp": {"d_model": 512, "d_hidden": 2048, "n_blocks": 4},
    "gpt": {"vocab": 512, "d_model": 128, "n_heads": 4, "n_layers": 4, "seq_len": 64},
    "tuple": {"d_model": 64, "d_hidden": 128, "n_blocks": 4, "n_buckets": 4},
    "looped-mlp": {"d_model": 512, "d_hidden": 2048, "n_blocks": 4, "loops": 2},
}

# Sizes a model accepts but leaves out of its defaults (absent: off), with their allowed values.
# gpt's fused_fb=1 builds FusedStage stages (see there).
OPTIONAL_SIZES: dict[str, dict[str, tuple[int, ...]]] = {"gpt": {"fused_fb": (0, 1)}}

_DESCRIPTIONS = {
    "mlp": "residual MLP blocks (LayerNorm, Linear, GELU, Linear); MSE loss",
    "gpt": "GPT-style decoder (embedding on the first stage, LM head + cross-entropy on the last)",
    "tuple": "MLP blocks passing (hidden, skip, int64 bucket ids) between stages; MSE loss",
    "looped-mlp": "residual MLP blocks, each applied `loops` times with the same weights "
    "(a weight used twice in a stage); MSE loss",
}


def model_names() -> dict[str, str]:
    """Model name -> one-line description."""
    return dict(_DESCRIPTIONS)



def build_model(name: str, n_stages: int, seed: int = 0, **sizes: int) -> BenchModel:
    """Build model ``name`` ("mlp", "gpt", "tuple", "looped-mlp", or a user's
    ``package.module:function``:
    see :mod:`vpipe.models.custom`) split into ``n_stages`` stages.

    Sizes default to ``DEFAULT_SIZES[name]``, except that ``n_blocks`` (the MLPs, "tuple") and
    ``n_layers`` ("gpt") grow to fit ``n_stages`` when not given. Pass sizes explicitly when
    comparing different splits of one model.
    """
    if n_stages < 1:
        raise ModelError(f"n_stages must be >= 1, got {n_stages}")
    full = resolve_sizes(name, n_stages, sizes)  # names an unknown model or size first
    if name not in _BUILDERS:
        from vpipe.models.custom import build_custom

        return build_custom(name, n_stages, seed, full)
    return _BUILDERS[name](n_stages, seed, full)


def resolve_sizes(name: str, n_stages: int, sizes: Mapping[str, int] | None = None) -> dict[str, int]:
    """Every size of model ``name`` split into ``n_stages``: the given ``sizes``, else the
    defaults, with ``n_blocks`` / ``n_layers`` grown to fit ``n_stages`` when not given.

    The one place for that rule: building a model, fixing a sweep's sizes across schedules
    (resolve for the largest stage count) and counting a calibrated model's pieces use it.
    """
    if ":" in name:  # a user's package.module:function: its sizes are its own
        return {k: int(v) for k, v in (sizes or {}).items()}
    if name not in DEFAULT_SIZES:
        raise ModelError(
            f"unknown model {name!r}: choose one of {', '.join(DEFAULT_SIZES)}, or give "
            "package.module:function"
        )
    sizes = dict(sizes or {})
    optional = OPTIONAL_SIZES.get(name, {})
    unknown = sorted(set(sizes) - set(DEFAULT_SIZES[name]) - set(optional))
    if unknown:
        known = [*DEFAULT_SIZES[name], *optional]
        raise ModelError(f"model {name!r} has no size {unknown[0]!r}: sizes are {', '.join(known)}")
    for key, allowed in optional.items():
        if key in sizes and int(sizes[key]) not in allowed:
            raise ModelError(
                f"model {name!r}: {key} must be one of {', '.join(map(str, allowed))}, "
                f"got {sizes[key]}"
            )
    full = dict(DEFAULT_SIZES[name])
    if "n_blocks" in full:
        full["n_blocks"] = max(full["n_blocks"], n_stages)
    if "n_layers" in full:
        full["n_layers"] = max(full["n_layers"], n_stages - 2)
    full.update({k: int(v) for k, v in sizes.items()})
    for key, value in full.items():
        if value < 1 and key not in optional:
            raise ModelError(f"model {name!r}: size {key} must be >= 1, got {value}")
    return full


def model_pieces(name: str, sizes: Mapping[str, int]) -> int:
    """How many equal-cost pieces a resolved model splits into: MLP blocks, or GPT's
    embedding, layers and head."""
    return sizes["n_layers"] + 2 if name == "gpt" else sizes["n_blocks"]


def _random_pair(d: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    def make_batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)

    return make_batch


# ---------------------------------------------------------------------------------------------
# MLP


class MLPBlock(nn.Module):
    """x + Linear(GELU(Linear(LayerNorm(x))))."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(lazy(self.act, self.fc1(self.norm(x))))


def _build_mlp(n_stages: int, seed: int, sizes: dict[str, int]) -> BenchModel:
    d, h, n = sizes["d_model"], sizes["d_hidden"], sizes["n_blocks"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = [MLPBlock(d, h) for _ in range(n)]
    stages = split_pieces(blocks, n_stages, "MLP blocks")
    return BenchModel("mlp", stages, mse_loss, sizes, seed, _random_pair(d))


class LoopedBlock(MLPBlock):
    """An :class:`MLPBlock` applied ``loops`` times in a row: every weight is used ``loops``
    times in one forward (a looped, weight-shared block), so its gradient sums over the uses."""

    def __init__(self, d: int, h: int, loops: int) -> None:
        super().__init__(d, h)
        self.loops = loops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.loops):
            x = super().forward(x)
        return x


def _build_looped_mlp(n_stages: int, seed: int, sizes: dict[str, int]) -> BenchModel:
    d, h, n, loops = sizes["d_model"], sizes["d_hidden"], sizes["n_blocks"], sizes["loops"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = [LoopedBlock(d, h, loops) for _ in range(n)]
    stages = split_pieces(blocks, n_stages, "looped MLP blocks")
    return BenchModel("looped-mlp", stages, mse_loss, sizes, seed, _random_pair(d))


# ---------------------------------------------------------------------------------------------
# GPT


class Embed(nn.Module):
    """Token plus learned position embedding (the first stage's first piece)."""

    def __init__(self, vocab: int, d: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.pos.shape[0]:
            raise ModelError(f"model 'gpt': {t} tokens exceed seq_len {self.pos.shape[0]}")
        return self.tok(tokens) + self.pos[:t]


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and MLP, both residual."""

    def __init__(self, d: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        for lin in (self.proj, self.fc2):  # GPT-2 style scaled init of residual projections
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = recomputed(_causal_attention, q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(lazy(F.gelu, self.fc1(self.ln2(x))))


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention's core: softmax(q k^T / sqrt(d)) v, causal."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class LMHead(nn.Module):
    """Final LayerNorm and LM head (the last stage's last piece); returns logits."""

    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of (batch, seq, vocab) logits against (batch, seq) ids, in
    float32 whatever the logits' precision (as mixed-precision training computes it)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error, in float32 whatever the inputs' precision."""
    return F.mse_loss(out.float(), target.float())


def _build_gpt(n_stages: int, seed: int, sizes: dict[str, int]) -> BenchModel:
    vocab, d, heads = sizes["vocab"], sizes["d_model"], sizes["n_heads"]
    layers, seq = sizes["n_layers"], sizes["seq_len"]
    if d % heads:
        raise ModelError(f"model 'gpt': d_model ({d}) must be divisible by n_heads ({heads})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pieces = [
            Embed(vocab, d, seq),
            *(DecoderBlock(d, heads, layers) for _ in range(layers)),
            LMHead(d, vocab),
        ]

    def make_batch(batch: int, bseed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(bseed)
        tokens = torch.randint(vocab, (batch, seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    stage = FusedStage if sizes.get("fused_fb") else Stage
    stages = split_pieces(pieces, n_stages, "GPT pieces (embedding, n_layers blocks, head)", stage)
    return BenchModel("gpt", stages, lm_loss, sizes, seed, make_batch, tokens_per_sample=seq)


# ---------------------------------------------------------------------------------------------
# Tuple


class TupleBlock(nn.Module):
    """(h, skip, bucket) -> (h', skip', bucket).

    The first block builds the tuple from a plain tensor (bucket: a data-dependent int64 id per
    sample); the last returns the single tensor h + skip. The int tensor crosses every stage
    boundary and selects a learned per-bucket bias, so it must arrive intact.
    """

    def __init__(self, d: int, h: int, n_buckets: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last, self.n_buckets = first, last, n_buckets
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)
        self.bias = nn.Embedding(n_buckets, d)
        self.gate = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, x: Any) -> Any:
        if self.first:
            hid, skip = x, x
            bucket = (x[:, 0].detach() * 1000).floor().long().remainder(self.n_buckets)
        else:
            hid, skip, bucket = x
        # remainder keeps ids valid even when a runtime probes shapes with uninitialised tensors
        hid = (
            hid
            + self.fc2(lazy(F.gelu, self.fc1(self.norm(hid))))
            + self.bias(bucket.remainder(self.n_buckets))
        )
        skip = skip * self.gate + hid * 0.1
        if self.last:
            return hid + skip
        return hid, skip, bucket


def _build_tuple(n_stages: int, seed: int, sizes: dict[str, int]) -> BenchModel:
    d, h, n, k = sizes["d_model"], sizes["d_hidden"], sizes["n_blocks"], sizes["n_buckets"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = [TupleBlock(d, h, k, i == 0, i == n - 1) for i in range(n)]
    stages = split_pieces(blocks, n_stages, "tuple blocks")
    return BenchModel("tuple", stages, mse_loss, sizes, seed, _random_pair(d))


_BUILDERS: dict[str, Callable[[int, int, dict[str, int]], BenchModel]] = {
    "mlp": _build_mlp,
    "gpt": _build_gpt,
    "tuple": _build_tuple,
    "looped-mlp": _build_looped_mlp,
}
