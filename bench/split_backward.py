"""Split backward against full backward: time of I then W against B on one stage.

vpipe's I computes only input gradients and W the weight gradients later, without recomputing
the input-gradient chain; this script measures what that split costs against one full B on a
stage of the benchmark MLP (one thread, B and I+W interleaved, medians). Pipeline step times of
vpipe against torch.distributed.pipelining come from ``vpipe bench --impl vpipe,torch``.

Run: ``python -m bench.split_backward --rows 4 32``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence


def split_backward_figures(
    d_model: int = 512, d_hidden: int = 2048, n_blocks: int = 1, rows: int = 4, repeats: int = 50
) -> dict[str, float]:
    """Median time of B and of (I then W) on one stage of the benchmark MLP, interleaved.

    ``rows`` is the microbatch size (the benchmark: batch 32 / 8 microbatches = 4).
    """
    import torch

    from vpipe.models import build_model
    from vpipe.runtime.backward import backward_full, backward_input, grad_node

    stage = build_model("mlp", 1, 0, d_model=d_model, d_hidden=d_hidden, n_blocks=n_blocks).stages[
        0
    ]
    params = list(stage.parameters())
    param_nodes = {grad_node(p): p for p in params}
    x0 = torch.randn(rows, d_model)
    g = torch.randn(rows, d_model)

    def run_b() -> float:
        x = x0.clone().requires_grad_(True)
        out = stage(x)
        t0 = time.perf_counter()
        backward_full([out], [g], [x])
        return time.perf_counter() - t0

    def run_iw() -> tuple[float, float]:
        x = x0.clone().requires_grad_(True)
        out = stage(x)
        t0 = time.perf_counter()
        _, task = backward_input([out], [g], [x], param_nodes)
        t1 = time.perf_counter()
        task.run()
        return t1 - t0, time.perf_counter() - t1

    for _ in range(5):
        run_b()
        run_iw()
    b_times, i_times, w_times, iw_ratio = [], [], [], []
    for _ in range(repeats):
        for p in params:
            p.grad = None
        b = run_b()
        for p in params:
            p.grad = None
        i, w = run_iw()
        b_times.append(b)
        i_times.append(i)
        w_times.append(w)
        iw_ratio.append((i + w) / b)
    return {
        "b_us": statistics.median(b_times) * 1e6,
        "i_us": statistics.median(i_times) * 1e6,
        "w_us": statistics.median(w_times) * 1e6,
        "iw_over_b_median": statistics.median(iw_ratio),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.split_backward", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rows", type=int, nargs="+", default=[4, 32], help="microbatch rows")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    for rows in args.rows:
        f = split_backward_figures(rows=rows)
        print(
            f"split backward, MLP block 512-2048, {rows} rows, 1 thread: B {f['b_us']:.0f} us, "
            f"I {f['i_us']:.0f} us + W {f['w_us']:.0f} us; median (I+W)/B = "
            f"{f['iw_over_b_median']:.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
