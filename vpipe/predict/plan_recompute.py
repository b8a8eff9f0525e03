"""Costs of a calibrated run under activation recomputation, for ``vpipe plan --recompute``.

From a run without recomputation (:class:`vpipe.predict.plan.CalibratedCosts`), each stage's
costs under a mode (:mod:`vpipe.runtime.recompute`):

- time: each B and I reruns a share of the stage's measured forward: under ``full`` the
  forward as the run's probe timed it alone, else all of it
  (:func:`vpipe.predict.recompute_share.full_shares`);
  under ``selective`` the share of it the run spent in the calls selective recomputation
  reruns (:mod:`vpipe.predict.recompute_share`); for a run recorded without those spans, the
  share of attention's core in a GPT block's multiply-adds (activation functions left out);
- memory: the stage's measured bytes per microbatch split into what F keeps and what the
  backward recomputes (held during B, and from I to W): ``full`` keeps the stage's input
  (one hidden state per row; stage 0: its token ids or input rows), ``selective`` recomputes
  each block's activation-function output (GPT: 4 x d_model per token; MLP and tuple blocks:
  d_hidden per row).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vpipe.errors import VpipeError

__all__ = ["with_recompute"]

_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def with_recompute(costs: Any, mode: str) -> Any:
    """``costs`` (a calibrated run's) as they are under recompute ``mode``."""
    if mode == "none":
        return costs
    meta = getattr(costs, "meta", None)
    if meta is None or meta.get("model") not in ("gpt", "mlp", "tuple"):
        raise VpipeError(
            f"--recompute {mode} needs costs calibrated on a run of a built-in model (--from "
            "STORE --run RUN): its shapes give what each mode keeps"
        )
    if str(meta.get("recompute") or "none") != "none":
        raise VpipeError(
            f"--recompute needs a calibration run without recomputation; run "
            f"{meta.get('run_id', '')!r} recomputed ({meta['recompute']})"
        )
    return _Recomputing(costs, mode)


@dataclass(frozen=True)
class _Recomputing:
    base: Any
    mode: str

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def cost_model(self, schedule: Any, rows: float) -> Any:
        from vpipe.models import resolve_sizes
        from vpipe.predict.pieces import split_sizes
        from vpipe.predict.recompute_share import full_shares, selective_shares

        cm = self.base.cost_model(schedule, rows)
        meta = self.base.meta
        model, n = meta["model"], schedule.n_stages
        sizes = resolve_sizes(model, int(meta.get("stages") or n), meta.get("sizes") or {})
        item = _ITEMSIZE.get(str(meta.get("dtype") or "fp32"), 4)
        pieces = split_sizes(self.base.pieces, n)
        act = cm.stage_activation_bytes(n)
        if self.mode == "full":
            per_row = sizes["d_model"] * item * (2 if model == "tuple" else 1)
            if model == "gpt":
                per_row *= sizes["seq_len"]
            kept = [rows * (sizes["seq_len"] * 8 if model == "gpt" and s == 0 else per_row)
                    for s in range(n)]  # fmt: skip
            share = full_shares(self.base.calibration, n, self.base.pieces)
            share = share if isinstance(share, float) else share.tolist()
        else:
            blocks = list(pieces)
            if model == "gpt":  # the embedding and the head are pieces without a block
                blocks[0] -= 1
                blocks[-1] -= 1
                lazy = 4 * sizes["d_model"] * sizes["seq_len"] * item
                d, t = sizes["d_model"], sizes["seq_len"]
                share = t * d / (12 * d * d + t * d)
            else:
                lazy, share = sizes["d_hidden"] * item, 0.0
            measured = selective_shares(self.base.calibration, n, self.base.pieces)
            share = share if measured is None else measured.tolist()
            kept = [act[s] - blocks[s] * lazy * rows for s in range(n)]
        kept = [min(k, a) for k, a in zip(kept, act, strict=True)]
        rec = [a - k for a, k in zip(act, kept, strict=True)]
        return replace(cm, activation_bytes=kept, recompute_bytes=rec, recompute=share)
