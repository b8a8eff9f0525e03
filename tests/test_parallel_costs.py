"""Tensor, context and sequence parallelism, recomputation and ZeRO on one GPU, against
hand-computed figures: Korthikanti et al. 2022's per-layer activation formulas, the bytes per
parameter of each ZeRO stage, and the bytes TP's, CP's and FSDP's collectives move."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vpipe.sim.arch import PRESETS as ARCHS
from vpipe.sim.arch import Arch
from vpipe.sim.efficiency import FITS, MEASURED_ERROR, efficiency_of
from vpipe.sim.machine import load_machine
from vpipe.sim.model_costs import Layout, Rates, layer_split, model_costs
from vpipe.sim.parallel import ParallelError, Split, block_on_gpu, elementwise_bytes

# GPT-3-like blocks as the paper counts them: no flash attention, dropout, a 4h MLP
S, B, H, A = 2048, 2, 1024, 16
GPT = Arch("gpt", layers=8, hidden=H, heads=A, seq_len=S, vocab=1000, microbatch=B,
           precision="bf16", dropout=True, flash_attention=False, learned_positions=True)  # fmt: skip
SBH = S * B * H
SCORES = 5 * A * S / H


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_korthikanti_activations_per_layer(t):
    def saved(**kw) -> float:
        return block_on_gpu(GPT, Split(tp=t, **kw)).saved_bytes

    assert saved(sp=False) == pytest.approx(SBH * (10 + 24 / t + SCORES / t))
    assert saved(sp=True) == pytest.approx(SBH * (34 / t + SCORES / t))
    assert saved(sp=False, recompute="selective") == pytest.approx(SBH * (10 + 24 / t))
    assert saved(sp=True, recompute="selective") == pytest.approx(SBH * 34 / t)
    assert saved(sp=False, recompute="full") == pytest.approx(2 * SBH)
    assert saved(sp=True, recompute="full") == pytest.approx(2 * SBH / t)
    if t == 1:  # the paper's unsplit figure
        assert saved() == pytest.approx(SBH * (34 + SCORES)) == GPT.layer_saved_bytes()


def test_context_parallel_splits_every_token_figure():
    one, two = block_on_gpu(GPT, Split()), block_on_gpu(GPT, Split(cp=2))
    assert two.saved_bytes == pytest.approx(one.saved_bytes / 2)
    assert two.flops["F"] == pytest.approx(one.flops["F"] / 2)
    # the K and V of this GPU's half of the tokens go round the ring once in F, twice in I
    kv = 2 * (S * B / 2) * GPT.kv_width * 2
    assert two.cp_bytes == {"F": kv, "I": 2 * kv}


@pytest.mark.parametrize(("tp", "sp", "per_pass"), [(4, True, 2 * 3 / 4), (4, False, 4 * 3 / 4),
                                                    (1, True, 0.0)])  # fmt: skip
def test_tensor_parallel_collectives_per_pass(tp, sp, per_pass):
    """Two all-gathers or reduce-scatters (each GPU sends (tp-1)/tp of t h values) per pass
    with sequence parallelism; two all-reduces (twice that) without."""
    blk = block_on_gpu(GPT, Split(tp=tp, sp=sp))
    assert blk.tp_bytes == pytest.approx(per_pass * S * B * H * 2)


@pytest.mark.parametrize(("tp", "sp"), [(1, True), (4, True), (4, False)])
def test_memory_bound_operators_bytes(tp, sp):
    """The norms, residual adds and dropout on the hidden width (split by TP only with SP),
    the GELU on the MLP's width and the scores' softmax and dropout (split by TP), counted
    by hand per operator (bf16, one-byte masks)."""
    moved = elementwise_bytes(GPT, Split(tp=tp, sp=sp))
    whole = S * B * H / (tp if sp else 1)
    # F: 2 norms (2 h) + 2 residual adds (3 h) + 2 dropouts (2 h and a mask byte)
    assert moved["norms"]["F"] == pytest.approx(whole * (2 * (4 + 6 + 4) + 2))
    # I: 2 norms and 2 adds (3 h each) + 2 dropouts (2 h and the mask)
    assert moved["norms"]["I"] == pytest.approx(whole * (2 * (6 + 6 + 4) + 2))
    width = S * B * 4 * H / tp
    assert (moved["mlp"]["F"], moved["mlp"]["I"]) == pytest.approx((width * 4, width * 6))
    scores = S * B * S * A / tp  # softmax (2 values) and its dropout (2 values, a mask byte)
    assert moved["scores"]["F"] == pytest.approx(scores * (4 + 5))
    assert moved["scores"]["I"] == pytest.approx(scores * (6 + 5))
    assert all(part["W"] == 0 for part in moved.values())
    flash = elementwise_bytes(replace(GPT, flash_attention=True), Split(tp=tp, sp=sp))
    assert flash["scores"]["F"] == 0  # inside the fused attention kernel
    # full recomputation moves F's bytes again before I, selective the scores' only
    full = block_on_gpu(GPT, Split(tp=tp, sp=sp, recompute="full"))
    sel = block_on_gpu(GPT, Split(tp=tp, sp=sp, recompute="selective"))
    assert full.recompute_elementwise_bytes == pytest.approx(full.elementwise_bytes["F"])
    assert sel.recompute_elementwise_bytes == pytest.approx(moved["scores"]["F"])


def test_recomputation_adds_forward_work_before_i():
    none, sel, full = (block_on_gpu(GPT, Split(recompute=r)) for r in ("none", "selective", "full"))
    assert none.recompute_flops == 0
    assert full.recompute_flops == GPT.layer_flops("F")
    assert sel.recompute_flops == pytest.approx(4 * B * S * S * H)  # scores and values, F
    assert full.working_bytes == pytest.approx(GPT.layer_saved_bytes())  # rebuilt in I


@pytest.mark.parametrize(
    ("shard", "weights", "grads", "opt"),
    [("none", 2, 4, 12), ("optimizer", 2, 4, 12 / 4), ("gradients", 2, 4 / 4, 12 / 4),
     ("full", 2 / 4, 4 / 4, 12 / 4)],
)  # fmt: skip
def test_zero_stages_bytes_per_parameter(shard, weights, grads, opt):
    m = load_machine("h100")
    c = model_costs(GPT, m, Layout(pp=2, dp=4, shard=shard, tp=2))
    part = c.extra["memory"][1]
    n = c.params[1]
    assert n == -(-(4 * GPT.layer_params() + GPT.head_params()) // 2)  # per GPU: TP halves it
    assert (part["weights"], part["gradients"], part["optimizer"]) == pytest.approx(
        (n * weights, n * grads, n * opt))  # fmt: skip
    assert c.static_bytes[1] == pytest.approx(n * (weights + grads + opt))


def test_fsdp_gathers_once_per_step_and_reduce_scatters_at_the_end():
    """ZeRO-3 with pipelines (torch's UNSHARD before a stage's first F, RESHARD after its last
    W): the rank's first stage's 16-bit parameters gathered, (dp-1)/dp of them per GPU, before
    its first F; the gradients reduce-scattered (half an all-reduce's bytes); the gathered
    weights and unsharded gradients held as buffers."""
    m = replace(load_machine("h100"), inter_node_bandwidth=1e9, intra_node_bandwidth=1e9,
                intra_node_latency=0.0, inter_node_latency=0.0)  # fmt: skip
    dp = 4
    rates = Rates(1e15, 1e15, 1e15)
    full = model_costs(GPT, m, Layout(pp=2, dp=dp, shard="full"), rates)
    none = model_costs(GPT, m, Layout(pp=2, dp=dp, shard="none"), rates)
    n_stage = 4 * GPT.layer_params() + GPT.embedding_params()
    assert full.extra["fsdp_s"][0] == pytest.approx((dp - 1) / dp * n_stage * 2 / 1e9)
    assert full.iteration_costs().tail[0] - none.iteration_costs().tail[0] == pytest.approx(
        full.extra["fsdp_s"][0] * 1e6)  # fmt: skip
    assert full.f == none.f  # prefetched: no pass waits on it
    cost, buckets = full.dp_reduction()
    _, whole = none.dp_reduction()
    assert buckets[0][0] == pytest.approx(whole[0][0] / 2)  # a reduce-scatter
    n = full.params[0]
    held = full.extra["memory"][0]
    assert held["buffers"] - none.extra["memory"][0]["buffers"] == pytest.approx(
        n * (2 + 4) * (1 - 1 / dp))  # fmt: skip
    assert held["weights"] == pytest.approx(n * 2 / dp)


def test_refused_splits_name_the_figure():
    with pytest.raises(ParallelError, match="tp=3 does not divide gpt's 16 heads"):
        Split(tp=3).check(GPT)
    with pytest.raises(ParallelError, match="key/value heads"):
        Split(tp=4).check(replace(GPT, heads=24, hidden=1536, kv_heads=6))
    Split(tp=16).check(replace(GPT, heads=32, hidden=2048, kv_heads=8))  # K and V copied
    with pytest.raises(ParallelError, match="cp=3"):
        Split(cp=3).check(GPT)


def test_llama_405b_splits_unevenly_with_the_embedding_and_head_as_a_layer_each():
    arch = ARCHS["llama3.1-405b"][0]
    assert (arch.layers, arch.hidden, arch.heads, arch.kv_width // 128) == (126, 16384, 128, 8)
    # PP 8 x 8 virtual stages: 64 stages of 2 units, the first and last hold 1 layer
    assert layer_split(arch.layers, 64) == [1] + [2] * 62 + [1]
    assert layer_split(10, 3) == [3, 4, 3]  # 12 units: 4 each, embedding and head one each


def test_efficiency_rises_with_the_gemm_shapes_and_stays_under_its_ceiling():
    low = efficiency_of("h100", "bf16", 1024, 512)
    high = efficiency_of("h100", "bf16", 16384, 8192)
    assert 0 < low < high < FITS["h100"].peak_share["bf16"]
    assert efficiency_of("h100", "bf16", 1024, 2048) > low
    assert MEASURED_ERROR["h200"] is None  # no published H200 rows
