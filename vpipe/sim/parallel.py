"""What tensor (TP), context (CP) and sequence parallelism and activation recomputation do to
one transformer block on one GPU: its FLOPs, the bytes its forward saves, and the bytes its
collectives move.

Per block and microbatch of ``t = b s`` tokens (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sections 4.2-5, generalised as :mod:`vpipe.sim.arch`
generalises section 4.1):

- **TP** splits every weight matrix, the attention heads and the MLP's width over ``tp`` GPUs:
  FLOPs and the activations inside attention and the MLP divide by ``tp``. Without sequence
  parallelism the norms' inputs, the inputs of the QKV and the MLP's first matrix and the
  dropout masks stay whole on every GPU (``10 s b h`` of the paper's ``34 s b h``); with it
  (``sp``, always on with TP here, as in Megatron-LM and NeMo) they are split over the sequence,
  so everything divides by ``tp``. Per block each pass has two collectives of ``t h`` values: in
  F an all-gather and a reduce-scatter before and after attention and the MLP (without SP, two
  all-reduces), the same in I. Each GPU sends ``(tp - 1) / tp`` of them per all-gather or
  reduce-scatter, twice that per all-reduce (a ring). I's two collectives carry the input
  gradients of the column-parallel matrices (QKV and the MLP's input): a fused backward (B)
  runs each beside that matrix's weight gradient (Megatron-LM's asynchronous TP
  communication), hiding up to that GEMM's time (``column_w_flops``); a split backward
  computes the weight gradients later, in W, so its I pays them whole.
- **CP** splits the sequence over ``cp`` GPUs: every per-token figure divides by ``cp``; the
  attention needs every other GPU's K and V, passed round a ring (``cp - 1`` steps of
  ``t / cp`` tokens' K and V in F; in I the K and V again and their gradients back), which
  overlaps the attention's own compute.
- **Recomputation**: ``selective`` keeps everything but attention's scores (the softmax, its
  dropout: the ``5 a s^2 b`` term) and recomputes them in I (the score and value products'
  F FLOPs again); ``full`` keeps only each block's input (``2 s b h`` bytes, split by TP with
  SP) and recomputes the whole block's F before its I.
- **Memory-bound work** (:func:`elementwise_bytes`): the operators between the matrices (the
  norms, residual adds, dropout, the MLP's activation, and without flash attention the
  scores' softmax and dropout) move bytes through HBM rather than use the tensor cores. Per
  token, F reads and writes: each norm ``2 h`` values, each residual add ``3 h``, each dropout
  ``2 h`` values and an ``h``-byte mask, the activation ``2 f`` (gated: ``3 f``), each score
  ``2`` values for the softmax and ``2`` and a mask byte for its dropout. Their backward (in
  I) reads the saved input and the gradient and writes a gradient: ``3 h`` per norm and
  residual add, ``2 h`` values and the mask per dropout, ``3 f`` (gated ``5 f``) for the
  activation, ``3`` per score. The ``h``-wide operators run on every TP GPU's whole sequence
  without SP and on its share with it; the rest divide by TP. These are the least traffic
  each operator needs (no fusion across them, none lost to caching): a floor, timed at the
  bandwidth the optimizer step gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from vpipe.errors import VpipeError
from vpipe.sim.arch import Arch

__all__ = ["RECOMPUTE", "ParallelError", "Split", "block_on_gpu", "elementwise_bytes",
           "head_elementwise_bytes"]

RECOMPUTE = ("none", "selective", "full")


class ParallelError(VpipeError, ValueError):
    """A split of the model that cannot work; the message names the figure that does not divide."""


@dataclass(frozen=True)
class Split:
    """How one block is split inside a pipeline rank: ``tp`` tensor-parallel GPUs (with
    sequence parallelism when ``sp``), ``cp`` context-parallel GPUs, and ``recompute``."""

    tp: int = 1
    cp: int = 1
    sp: bool = True
    recompute: str = "none"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.cp < 1:
            raise ParallelError(f"tp and cp must be >= 1, got tp={self.tp}, cp={self.cp}")
        if self.recompute not in RECOMPUTE:
            raise ParallelError(f"recompute must be one of {', '.join(RECOMPUTE)}, got "
                                f"{self.recompute!r}")  # fmt: skip

    def check(self, arch: Arch) -> None:
        """Refuse a split the model cannot take (heads, key/value heads or the sequence not
        dividing), in one line."""
        kv = arch.kv_heads or arch.heads
        if arch.heads % self.tp:
            raise ParallelError(f"tp={self.tp} does not divide {arch.name}'s {arch.heads} heads")
        if kv % self.tp and self.tp % kv:
            raise ParallelError(f"tp={self.tp} and {arch.name}'s {kv} key/value heads: neither "
                                f"divides the other")  # fmt: skip
        if arch.seq_len % (2 * self.cp if self.cp > 1 else 1):
            raise ParallelError(f"cp={self.cp} does not split a sequence of {arch.seq_len} "
                                f"tokens into 2 x cp equal chunks")  # fmt: skip


@dataclass(frozen=True)
class BlockOnGPU:
    """One block's per-GPU figures for one microbatch (FLOPs, bytes); see the module docstring."""

    flops: dict[str, float]  # "F", "I", "W": the model's work on this GPU
    recompute_flops: float  # extra F work done before I
    saved_bytes: float  # what F keeps for backward
    held_after_i: float  # what I leaves for W
    working_bytes: float  # what one block's backward rebuilds while it runs (recompute)
    tp_bytes: float  # sent per GPU by TP's collectives, per pass (F, and again I)
    cp_bytes: dict[str, float]  # sent per GPU round CP's ring, per pass ("F", "I")
    attention_flops: dict[str, float]  # the score and value products' share of ``flops``
    elementwise_bytes: dict[str, float]  # memory traffic of the non-matrix operators, per pass
    recompute_elementwise_bytes: float  # what the recomputation before I moves again
    column_w_flops: tuple[float, float]  # W of QKV and of the MLP's input matrices, this GPU


def block_on_gpu(arch: Arch, split: Split) -> BlockOnGPU:
    """One block of ``arch`` split as ``split`` (see the module docstring)."""
    tp, cp = split.tp, split.cp
    n = tp * cp
    flops = {k: arch.layer_flops(k) / n for k in "FIW"}
    core = {k: arch.layer_flops(k) - 2.0 * arch.tokens * arch.layer_matrix_params() for k in "FI"}
    attention = {k: v / n for k, v in core.items()}
    h, v = arch.hidden, arch.value_bytes
    t = arch.tokens / cp
    whole = arch.layer_saved_bytes() / cp  # this GPU's tokens, nothing split by TP yet
    scores = _score_bytes(arch) / cp
    masks = 2 * arch.tokens * h / cp if arch.dropout else 0.0
    replicated = t * 4 * h * v + masks  # the norms' inputs, the QKV and MLP inputs, the masks
    split_part = whole - replicated
    saved = (replicated / tp if split.sp else replicated) + split_part / tp
    if split.recompute == "selective":
        saved -= scores / tp
    working = 0.0
    extra = 0.0
    if split.recompute == "full":
        working = saved
        saved = 2.0 * t * h / (tp if split.sp else 1)
        extra = flops["F"]
    elif split.recompute == "selective":
        working = scores / tp
        extra = attention["F"]
    held = arch.layer_weight_grad_bytes() / n
    values = t * h * v  # one collective's tensor on this GPU's tokens
    tp_bytes = 0.0 if tp == 1 else 2 * values * (tp - 1) / tp * (1 if split.sp else 2)
    kv_bytes = 2 * t * arch.kv_width * v
    cp_f = (cp - 1) * kv_bytes
    moved = elementwise_bytes(arch, split)
    total = {k: sum(part[k] for part in moved.values()) for k in "FIW"}
    again = {"none": 0.0, "selective": moved["scores"]["F"], "full": total["F"]}[split.recompute]
    qkv = h * (h + 2 * arch.kv_width)
    mlp_in = (2 if arch.gated_mlp else 1) * h * arch.ffn_width
    column = (2.0 * arch.tokens * qkv / n, 2.0 * arch.tokens * mlp_in / n)
    return BlockOnGPU(flops, extra, saved, held, working, tp_bytes, {"F": cp_f, "I": 2 * cp_f},
                      attention, total, again, column)  # fmt: skip


def elementwise_bytes(arch: Arch, split: Split) -> dict[str, dict[str, float]]:
    """Bytes one block's non-matrix operators move through memory on one GPU per microbatch,
    per pass (``"F"``, ``"I"``, ``"W"``: none) and part: ``"norms"`` (norms, residual adds,
    dropout on the hidden width), ``"mlp"`` (the activation) and ``"scores"`` (the softmax
    and dropout of attention's scores, 0 with flash attention); see the module docstring."""
    tp, cp, v = split.tp, split.cp, arch.value_bytes
    t, h, f = arch.tokens / cp, arch.hidden, arch.ffn_width
    whole = t * h / (tp if split.sp else 1)  # values per h-wide tensor on this GPU
    drop = arch.dropout
    norms_f = whole * (v * (2 * 2 + 2 * 3 + (2 * 2 if drop else 0)) + (2 if drop else 0))
    norms_i = whole * (v * (2 * 3 + 2 * 3 + (2 * 2 if drop else 0)) + (2 if drop else 0))
    width = t * f / tp
    mlp_f = width * v * (3 if arch.gated_mlp else 2)
    mlp_i = width * v * (5 if arch.gated_mlp else 3)
    scores = 0.0 if arch.flash_attention else t * arch.seq_len * arch.heads / tp
    scores_f = scores * (2 * v + ((2 * v + 1) if drop else 0))
    scores_i = scores * (3 * v + ((2 * v + 1) if drop else 0))
    return {"norms": {"F": norms_f, "I": norms_i, "W": 0.0},
            "mlp": {"F": mlp_f, "I": mlp_i, "W": 0.0},
            "scores": {"F": scores_f, "I": scores_i, "W": 0.0}}  # fmt: skip


def _score_bytes(arch: Arch) -> float:
    """Bytes of attention's scores a block saves (0 with flash attention)."""
    if arch.flash_attention:
        return 0.0
    v = arch.value_bytes
    per_score = v + (v + 1 if arch.dropout else 0)
    return per_score * arch.microbatch * arch.heads * arch.seq_len**2


def head_elementwise_bytes(arch: Arch, split: Split) -> dict[str, float]:
    """Bytes the final norm and the loss move on one GPU per microbatch and pass: the norm as
    a block's; the cross-entropy over the GPU's share of the logits in fp32 (F reads the
    logits, writes their exponentials and reads them back for the sum and the loss; I reads
    them and writes the logits' gradient)."""
    tp, cp, v = split.tp, split.cp, arch.value_bytes
    t = arch.tokens / cp
    whole = t * arch.hidden / (tp if split.sp else 1)
    logits = t * arch.vocab / tp
    return {"F": whole * 2 * v + logits * (v + 8), "I": whole * 3 * v + logits * (4 + v),
            "W": 0.0}
