"""`python -m bench.cluster_published` on rows of the shared table's shape: the published
figures are compared with, never used (scaling them changes no prediction), and the error
table's median and worst per source are what the rows say."""

from __future__ import annotations

import pytest

from bench import cluster_published as cp
from vpipe.sim.efficiency import FITS


def rows(scale: float = 1.0) -> dict:
    return {"rows": [
        {"source": "megatron_h100", "model": "small", "heads": 8, "hidden": 512, "layers": 4,
         "tp": 2, "pp": 2, "dp": 2, "gpus": 8, "global_batch": 8, "seq_len": 512,
         "vocab": 1024, "tflops_per_gpu": 100.0 * scale},
        {"source": "narayanan_2021", "model": "small", "heads": 8, "hidden": 512, "layers": 4,
         "tp": 1, "pp": 2, "dp": 2, "gpus": 4, "global_batch": 8, "seq_len": 512,
         "vocab": 1024, "tflops_per_gpu_incl_recompute": 50.0 * scale, "recompute": "full"},
        {"source": "nemo_24_07", "model": "LLAMA2-13B", "gpus": 16, "global_batch": 16,
         "microbatch": 1, "seq_len": 1024, "tp": 1, "pp": 4, "cp": 1, "virtual_stages": 2,
         "tokens_per_s_per_gpu": 5000.0 * scale},
        {"source": "nemo_24_07", "model": "Nemotron-22B", "gpus": 16, "global_batch": 16,
         "microbatch": 1, "seq_len": 1024, "tp": 1, "pp": 4, "cp": 1, "virtual_stages": 2,
         "tokens_per_s_per_gpu": 1.0},
    ]}  # fmt: skip


def test_published_figures_change_no_prediction():
    a = cp.errors(cp.rows_of(rows(1.0)), FITS)
    b = cp.errors(cp.rows_of(rows(1.7)), FITS)
    assert [r["row"]["model"] for r in a] == ["small", "small", "LLAMA2-13B"]  # no 22B shape
    assert [r["predicted"] for r in a] == [r["predicted"] for r in b]
    for r in a:
        assert r["predicted"] > 0
        assert r["error"] == pytest.approx(r["predicted"] / r["setup"]["published"] - 1)
    # the source's FLOP formula turns TFLOP/s into tokens/s: 72 B s l h^2 (1 + s/6h + V/12lh)
    s, h, l, v = 512, 512, 4, 1024
    flops = 72 * 8 * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert a[0]["setup"]["published"] == pytest.approx(100e12 * 8 * s / flops)
    assert a[1]["setup"]["recompute"] == "full" and a[2]["setup"]["v"] == 2
    table = cp.by_source(a, "source")
    assert table["nemo_24_07"] == (1, abs(a[2]["error"]), abs(a[2]["error"]))
    assert cp.by_source(a, "machine")["h100"][0] == 2
