"""A transformer described by its shape, and what one microbatch of it costs: FLOPs of the
forward (F), input-gradient (I) and weight-gradient (W) passes, parameters, activation bytes
saved for backward and the bytes a stage sends to the next.

An :class:`Arch` is a decoder stack: an embedding, ``layers`` identical blocks (attention with
``heads`` query heads and ``kv_heads`` key/value heads, then an MLP of width ``ffn``, gated
as SwiGLU or not), a final norm and an LM head over ``vocab``. It is read from a preset name
(:data:`PRESETS`), a Hugging Face ``config.json`` (Llama-style or GPT-2-style keys), or a JSON
file of this class's own fields (:func:`load_arch`).

Counts, per microbatch of ``b`` sequences of ``s`` tokens (``t = b s``), hidden ``h``:

- **FLOPs** (a multiply-add is 2): every weight matrix of ``n`` parameters costs ``2 t n`` in F,
  again in I (the gradient of its input) and in W (the gradient of its weight). Attention's
  score and value products cost ``4 b s^2 h`` in F and ``8 b s^2 h`` in I (no weights, so
  nothing in W); with ``flash_attention`` the masked half of a causal product is skipped
  (halved) and I recomputes the scores (``+2 b s^2 h`` before halving). The LM head is a
  ``h x vocab`` matrix; the embedding is a lookup (no FLOPs counted).
- **Activations saved by F** (Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", section 4.1, generalised): the inputs of the two norms, of every
  weight matrix and of the activation function, Q, K and V, the attention output, dropout masks
  (one byte per value) and, without flash attention, the softmax output, its dropout mask and
  its dropped-out copy (``5 a s^2 b`` bytes in 16 bits). GPT-3-like blocks give
  ``s b h (34 + 5 a s / h)`` bytes, the paper's figure.
- **Held after I for W**: the input of every weight matrix and the gradient of its output
  (what a weight gradient needs); GPT-3-like blocks give ``32 s b h``. What I frees is what F
  saved less what stays held; :meth:`Arch.i_frees` is that share (0 when W needs as much as F
  saved, as in Llama-style blocks with flash attention).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from vpipe.errors import VpipeError
from vpipe.sim.cost_model import read_json_object

__all__ = ["PRESETS", "Arch", "ArchError", "load_arch"]

# fp8: GEMMs at the fp8 peak; activations, weights and messages counted in 16 bits (the
# Transformer Engine recipes keep most of them in bf16; assumed).
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


class ArchError(VpipeError, ValueError):
    """A model description that cannot be used; the message names the file and key."""


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer (see the module docstring); ``microbatch`` sequences of
    ``seq_len`` tokens per microbatch, activations and weights in ``precision``."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    kv_heads: int = 0  # 0: as many as heads
    ffn: int = 0  # 0: 4 * hidden
    microbatch: int = 1
    precision: str = "bf16"
    gated_mlp: bool = False  # SwiGLU: gate, up and down matrices
    dropout: bool = False  # dropout after attention and MLP (masks saved)
    flash_attention: bool = True
    tied_embeddings: bool = True
    learned_positions: bool = False  # a seq_len x hidden position table

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "seq_len", "vocab", "microbatch"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArchError(f"model {self.name!r}: {key} must be an integer >= 1, got {value!r}")
        if self.precision not in BYTES:
            raise ArchError(
                f"model {self.name!r}: precision must be one of {', '.join(BYTES)}, "
                f"got {self.precision!r}"
            )
        if self.hidden % self.heads:
            raise ArchError(f"model {self.name!r}: hidden {self.hidden} is not a multiple of "
                            f"heads {self.heads}")  # fmt: skip
        if self.kv_heads < 0 or (self.kv_heads and self.heads % self.kv_heads):
            raise ArchError(f"model {self.name!r}: kv_heads {self.kv_heads} must divide heads "
                            f"{self.heads}")  # fmt: skip

    # -- shape ------------------------------------------------------------------------------
    @property
    def value_bytes(self) -> int:
        """Bytes of one activation or weight value."""
        return BYTES[self.precision]

    @property
    def kv_width(self) -> int:
        """Width of K (and of V): key/value heads times the head size."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def tokens(self) -> int:
        """Tokens of one microbatch."""
        return self.microbatch * self.seq_len

    def with_microbatch(self, microbatch: int) -> Arch:
        return replace(self, microbatch=microbatch)

    # -- parameters -------------------------------------------------------------------------
    def layer_matrix_params(self) -> int:
        """Weights of one block's matrices (Q, K, V, output; the MLP's two or three)."""
        h = self.hidden
        attention = 2 * h * h + 2 * h * self.kv_width
        return attention + (3 if self.gated_mlp else 2) * h * self.ffn_width

    def layer_params(self) -> int:
        """All of one block's parameters (matrices, and two norms' scale and shift)."""
        return self.layer_matrix_params() + 4 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    def head_params(self) -> int:
        """The final norm and the LM head's matrix (a copy of the embedding when tied)."""
        return self.vocab * self.hidden + 2 * self.hidden

    def params(self) -> int:
        """The whole model's parameters (a tied head counted once)."""
        head = 2 * self.hidden if self.tied_embeddings else self.head_params()
        return self.layers * self.layer_params() + self.embedding_params() + head

    # -- FLOPs per microbatch ----------------------------------------------------------------
    def layer_flops(self, kind: str) -> float:
        """FLOPs of one block's pass ``kind`` (``"F"``, ``"I"`` or ``"W"``) for one microbatch."""
        t, s, h = self.tokens, self.seq_len, self.hidden
        matrices = 2.0 * t * self.layer_matrix_params()
        core = {"F": 4.0, "I": 8.0, "W": 0.0}[_kind(kind)] * t * s * h
        if self.flash_attention:  # causal blocks skipped; I recomputes the scores
            core = (core + (2.0 * t * s * h if kind == "I" else 0.0)) / 2
        return matrices + core

    def head_flops(self, kind: str) -> float:
        """FLOPs of the LM head's pass ``kind`` for one microbatch (the same for F, I, W)."""
        _kind(kind)
        return 2.0 * self.tokens * self.hidden * self.vocab

    def model_flops(self) -> float:
        """FLOPs of one microbatch's F, I and W over the whole model."""
        return sum(self.layers * self.layer_flops(k) + self.head_flops(k) for k in "FIW")

    # -- bytes per microbatch ----------------------------------------------------------------
    def layer_saved_bytes(self) -> float:
        """Bytes one block's F saves for backward (see the module docstring)."""
        t, h, f, kv, v = self.tokens, self.hidden, self.ffn_width, self.kv_width, self.value_bytes
        norms = 2 * h
        attention = h + h + 2 * kv + h  # the QKV input, Q, K and V, the attention output
        mlp = h + (3 * f if self.gated_mlp else 2 * f)  # input; activation input(s) and output
        values = t * (norms + attention + mlp) * v
        masks = 2 * t * h if self.dropout else 0  # one byte per value
        scores = 0.0
        if not self.flash_attention:
            # the softmax output; with dropout its mask and the dropped-out copy too
            per_score = v + (v + 1 if self.dropout else 0)
            scores = per_score * self.microbatch * self.heads * self.seq_len**2
        return values + masks + scores

    def layer_weight_grad_bytes(self) -> float:
        """Bytes one block holds after I for its W: every matrix's input and output gradient."""
        t, h, f, kv = self.tokens, self.hidden, self.ffn_width, self.kv_width
        inputs = h + h + h + f  # QKV input, output projection input, MLP input, down input
        outputs = (h + 2 * kv) + h + (2 * f if self.gated_mlp else f) + h
        return t * (inputs + outputs) * self.value_bytes

    def embedding_saved_bytes(self) -> float:
        """Bytes the embedding saves: the token ids (int64)."""
        return 8.0 * self.tokens

    def head_saved_bytes(self) -> float:
        """Bytes the final norm, LM head and loss save: the norm's input and output, and the
        logits' softmax in fp32."""
        return self.tokens * (2 * self.hidden * self.value_bytes + 4 * self.vocab)

    def head_weight_grad_bytes(self) -> float:
        """Bytes the LM head holds after I for W: its input and the logits' gradient."""
        return self.tokens * (self.hidden + self.vocab) * self.value_bytes

    def i_frees(self) -> float:
        """The share of a block's saved bytes its I frees (0 when W holds as much)."""
        saved = self.layer_saved_bytes()
        return max(0.0, 1.0 - self.layer_weight_grad_bytes() / saved)

    def boundary_bytes(self) -> float:
        """Bytes of the activation (or its gradient) one stage sends the next per microbatch."""
        return float(self.tokens * self.hidden * self.value_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _kind(kind: str) -> str:
    if kind not in ("F", "I", "W"):
        raise ArchError(f"pass kind must be 'F', 'I' or 'W', got {kind!r}")
    return kind


# Presets: each from its authors' published configuration.
_LLAMA = Arch("llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
              seq_len=4096, vocab=32000, gated_mlp=True, tied_embeddings=False)  # fmt: skip
PRESETS: dict[str, tuple[Arch, str]] = {
    "llama2-70b": (_LLAMA, "config.json of meta-llama/Llama-2-70b-hf (Hugging Face)"),
    "llama3-70b": (
        replace(_LLAMA, name="llama3-70b", seq_len=8192, vocab=128256),
        "config.json of meta-llama/Meta-Llama-3-70B (Hugging Face)",
    ),
    "llama3.1-405b": (
        replace(_LLAMA, name="llama3.1-405b", layers=126, hidden=16384, heads=128, ffn=53248,
                seq_len=8192, vocab=128256),
        "config.json of meta-llama/Llama-3.1-405B (Hugging Face); seq_len 8192, the pre-training "
        "length of Dubey et al. 2024 (the config's 131072 is the extended context)",
    ),
    "llama3-8b": (
        replace(_LLAMA, name="llama3-8b", layers=32, hidden=4096, heads=32, ffn=14336,
                seq_len=8192, vocab=128256),
        "config.json of meta-llama/Meta-Llama-3-8B (Hugging Face)",
    ),
    "gpt3-175b": (
        Arch("gpt3-175b", layers=96, hidden=12288, heads=96, seq_len=2048, vocab=50257,
             dropout=True, learned_positions=True),
        "Brown et al. 2020, Language Models are Few-Shot Learners, Table 2.1",
    ),
}  # fmt: skip


def load_arch(text: str, **overrides: Any) -> Arch:
    """An :class:`Arch` from a preset name, a Hugging Face ``config.json`` or a JSON file of
    :class:`Arch` fields; ``overrides`` (e.g. ``seq_len``, ``microbatch``) replace fields."""
    if text in PRESETS:
        arch = PRESETS[text][0]
    else:
        data, path = read_json_object(text, "--arch", PRESETS, ArchError)
        arch = from_config(data, path.stem if path.name != "config.json" else path.parent.name,
                           str(path))  # fmt: skip
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(arch, **given) if given else arch


_OWN = {f.name for f in fields(Arch)}


def from_config(data: dict[str, Any], name: str, where: str = "config") -> Arch:
    """An :class:`Arch` from a config dict: this class's fields, or Hugging Face keys
    (Llama-style: ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
    ``num_key_value_heads``, ``intermediate_size``, ``tie_word_embeddings``; GPT-2-style:
    ``n_layer``, ``n_embd``, ``n_head``, ``n_inner``, ``n_positions``)."""
    if "layers" in data and "hidden" in data:
        unknown = sorted(set(data) - _OWN)
        if unknown:
            raise ArchError(f"{where}: unknown key {unknown[0]!r} (fields: {', '.join(sorted(_OWN))})")
        return Arch(**{"name": name, **data})
    if "n_layer" in data:  # GPT-2 style
        keys = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "vocab": "vocab_size",
                "seq_len": "n_positions"}  # fmt: skip
        got = _required(data, keys, where)
        return Arch(
            name=name, **got, ffn=int(data.get("n_inner") or 0), dropout=True,
            learned_positions=True, tied_embeddings=bool(data.get("tie_word_embeddings", True)),
            precision=_precision(data, "fp32"),
        )  # fmt: skip
    keys = {"layers": "num_hidden_layers", "hidden": "hidden_size",
            "heads": "num_attention_heads", "vocab": "vocab_size",
            "seq_len": "max_position_embeddings"}  # fmt: skip
    got = _required(data, keys, where)
    act = str(data.get("hidden_act", "silu"))
    return Arch(
        name=name, **got, kv_heads=int(data.get("num_key_value_heads") or 0),
        ffn=int(data.get("intermediate_size") or 0), gated_mlp=act in ("silu", "swish"),
        tied_embeddings=bool(data.get("tie_word_embeddings", False)),
        precision=_precision(data, "bf16"),
    )  # fmt: skip


def _required(data: dict[str, Any], keys: dict[str, str], where: str) -> dict[str, int]:
    out = {}
    for ours, theirs in keys.items():
        value = data.get(theirs)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ArchError(f"{where}: {theirs} must be an integer, got {value!r}")
        out[ours] = value
    return out


def _precision(data: dict[str, Any], default: str) -> str:
    dtype = str(data.get("torch_dtype", ""))
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, default)
