"""What an input gradient frees, measured against the model's count: bytes autograd saves for
backward after F, after I and after W of one microbatch of the gpt model's middle stage, on
CPU (:func:`vpipe.runtime.saved_share.saved_around_i`), next to what
:class:`vpipe.sim.arch.Arch` predicts: F's saved bytes, and the bytes a runtime that frees
what W does not need would hold after I (the zero-bubble implementation's, the share a cluster
plan assumes by default).

Run: ``python -m bench.saved_share``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

SIZES = ((128, 4, 64, 4), (256, 8, 128, 2), (512, 8, 256, 1))  # d_model, heads, seq, rows


def figures(d_model: int, heads: int, seq: int, rows: int) -> dict[str, float]:
    import torch

    from vpipe.models import build_model
    from vpipe.runtime.saved_share import saved_around_i
    from vpipe.sim.arch import Arch

    torch.manual_seed(0)
    sizes = dict(vocab=512, d_model=d_model, n_heads=heads, n_layers=4, seq_len=seq)
    stage = build_model("gpt", 3, **sizes).stages[1]  # two decoder blocks
    x, g = torch.randn(rows, seq, d_model), torch.randn(rows, seq, d_model)
    got = saved_around_i(stage, (x,), (g,))
    arch = Arch("gpt", layers=4, hidden=d_model, heads=heads, seq_len=seq, vocab=512,
                microbatch=rows, precision="fp32")  # fmt: skip
    stage_input = x.numel() * 4  # the previous stage's output: not counted as saved here
    return {
        "measured_f": got.after_f,
        "predicted_f": 2 * arch.layer_saved_bytes() - stage_input,
        "measured_i": got.after_i,
        "freeing_i": 2 * arch.layer_weight_grad_bytes(),
        "after_w": got.after_w,
        "measured_share": got.i_frees,
        "freeing_share": arch.i_frees(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m bench.saved_share", description=__doc__.split("\n")[0]).parse_args(argv)
    print(f"{'d_model':>8}{'heads':>6}{'seq':>5}{'rows':>5}{'F saved KiB':>13}{'predicted':>11}"
          f"{'err':>7}{'after I':>10}{'freeing':>9}{'after W':>9}{'I frees':>9}{'freeing':>9}")
    for d, h, s, r in SIZES:
        f = figures(d, h, s, r)
        kib = 1024
        print(f"{d:>8}{h:>6}{s:>5}{r:>5}{f['measured_f'] / kib:>13.0f}{f['predicted_f'] / kib:>11.0f}"
              f"{f['predicted_f'] / f['measured_f'] - 1:>+7.1%}{f['measured_i'] / kib:>10.0f}"
              f"{f['freeing_i'] / kib:>9.0f}{f['after_w'] / kib:>9.0f}"
              f"{f['measured_share']:>9.2f}{f['freeing_share']:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
