"""Costs from the model and the machine: FLOP, parameter and byte counts against hand-computed
cases, config parsing (Hugging Face Llama- and GPT-2-style, vpipe's own fields), the machine
presets and their sources, per-stage costs of a layout, and the iteration's end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from vpipe.ir import Schedule, actions_from_strings
from vpipe.schedules import make_schedule
from vpipe.sim import CostModel, simulate
from vpipe.sim.activation_memory import activation_peaks
from vpipe.sim.arch import PRESETS as ARCHS
from vpipe.sim.arch import Arch, ArchError, load_arch
from vpipe.sim.iteration import IterationCosts, iteration
from vpipe.sim.machine import PRESETS, MachineError, load_machine
from vpipe.sim.model_costs import (
    ADAM_BYTES,
    MEMORY_EFFICIENCY,
    Layout,
    ModelCostError,
    Rates,
    layer_split,
    model_costs,
)

# 2 layers, hidden 8, 2 heads, 4 tokens a sequence, 3 sequences a microbatch: t = 12 tokens
TINY = Arch("tiny", layers=2, hidden=8, heads=2, seq_len=4, vocab=10, microbatch=3,
            flash_attention=False, precision="fp16")  # fmt: skip


def test_flops_of_a_block_by_hand():
    # matrices: Q, K, V, output 4 x 8 x 8 = 256; MLP 2 x 8 x 32 = 512 -> 768 parameters
    assert TINY.layer_matrix_params() == 768
    t = 12
    assert TINY.layer_flops("F") == 2 * t * 768 + 4 * t * 4 * 8  # + QK^T and AV: 4 t s h
    assert TINY.layer_flops("I") == 2 * t * 768 + 8 * t * 4 * 8
    assert TINY.layer_flops("W") == 2 * t * 768
    assert TINY.head_flops("F") == 2 * t * 8 * 10
    flash = Arch("f", layers=2, hidden=8, heads=2, seq_len=4, vocab=10, microbatch=3)
    assert flash.layer_flops("F") == 2 * t * 768 + 2 * t * 4 * 8  # causal half
    assert flash.layer_flops("I") == 2 * t * 768 + (8 + 2) * t * 4 * 8 / 2  # + recomputed scores
    with pytest.raises(ArchError, match="'F', 'I' or 'W'"):
        TINY.layer_flops("B")


def test_grouped_query_and_gated_mlp_by_hand():
    a = Arch("g", layers=1, hidden=8, heads=4, kv_heads=2, ffn=12, seq_len=4, vocab=10,
             gated_mlp=True)  # fmt: skip
    assert a.kv_width == 4  # 2 kv heads of head size 2
    assert a.layer_matrix_params() == 8 * 8 * 2 + 2 * 8 * 4 + 3 * 8 * 12
    assert a.layer_params() == a.layer_matrix_params() + 4 * 8


def test_parameters_by_hand():
    a = Arch("p", layers=3, hidden=4, heads=2, seq_len=5, vocab=7, learned_positions=True)
    assert a.layer_params() == 12 * 16 + 16  # 4 matrices h^2, MLP 8 h^2; two norms 4 h
    assert a.embedding_params() == 7 * 4 + 5 * 4
    assert a.head_params() == 7 * 4 + 8
    assert a.params() == 3 * a.layer_params() + a.embedding_params() + 8  # tied: norm only


def test_activation_bytes_are_korthikantis_for_gpt3_like_blocks():
    a = Arch("gpt", layers=1, hidden=4096, heads=32, seq_len=1024, vocab=50304, microbatch=3,
             precision="fp16", dropout=True, flash_attention=False)  # fmt: skip
    s, b, h, heads = 1024, 3, 4096, 32
    assert a.layer_saved_bytes() == s * b * h * (34 + 5 * heads * s / h)
    assert a.layer_weight_grad_bytes() == 32 * s * b * h
    assert a.i_frees() == pytest.approx(1 - 32 / (34 + 5 * heads * s / h))
    assert a.boundary_bytes() == s * b * h * 2


def test_llama_blocks_with_flash_attention_free_nothing_at_i():
    a = ARCHS["llama3-70b"][0]
    assert a.layer_weight_grad_bytes() >= a.layer_saved_bytes()
    assert a.i_frees() == 0.0


def test_hugging_face_llama_config(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 8192,
              "intermediate_size": 28672, "max_position_embeddings": 8192,
              "model_type": "llama", "num_attention_heads": 64, "num_hidden_layers": 80,
              "num_key_value_heads": 8, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "vocab_size": 128256}  # fmt: skip
    path = tmp_path / "llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    a = load_arch(str(path), seq_len=4096)
    assert (a.name, a.layers, a.hidden, a.heads, a.kv_heads, a.ffn) == (
        "llama", 80, 8192, 64, 8, 28672)  # fmt: skip
    assert (a.seq_len, a.vocab, a.precision, a.gated_mlp, a.tied_embeddings) == (
        4096, 128256, "bf16", True, False)  # fmt: skip
    assert a.layer_matrix_params() == ARCHS["llama3-70b"][0].layer_matrix_params()
    # about 70.6e9 parameters, as Meta counts the model
    assert a.params() == pytest.approx(70.55e9, rel=0.01)


def test_gpt2_config_and_own_fields(tmp_path):
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
                                "vocab_size": 50257, "n_inner": None}))  # fmt: skip
    a = load_arch(str(gpt2))
    assert (a.layers, a.hidden, a.ffn_width, a.dropout, a.learned_positions) == (
        12, 768, 3072, True, True)  # fmt: skip
    assert a.params() == pytest.approx(124.4e6, rel=0.01)  # GPT-2 small
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32,
                               "vocab": 100, "microbatch": 2}))  # fmt: skip
    assert load_arch(str(own)) == Arch("own", layers=4, hidden=64, heads=4, seq_len=32,
                                       vocab=100, microbatch=2)  # fmt: skip


@pytest.mark.parametrize(
    ("content", "message"),
    [("{", "not a JSON file"), ("[1]", "expected a JSON object"),
     ('{"num_hidden_layers": 2, "hidden_size": 8}', "num_attention_heads must be an integer"),
     ('{"layers": 2, "hidden": 8, "heads": 2, "seq_len": 4, "vocab": 9, "wings": 1}',
      "unknown key 'wings'"),
     ('{"layers": 2, "hidden": 9, "heads": 2, "seq_len": 4, "vocab": 9}', "not a multiple")],
)  # fmt: skip
def test_bad_configs_name_the_file_and_key(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ArchError, match=message):
        load_arch(str(path))


def test_unknown_arch_lists_the_presets():
    with pytest.raises(ArchError, match="presets: llama2-70b"):
        load_arch("llama-9000")


def test_machine_presets_cite_their_sources():
    for name, m in PRESETS.items():
        assert m.name == name
        for key in ("peak_flops", "memory_bandwidth", "memory", "gpus_per_node",
                    "intra_node_bandwidth", "inter_node_bandwidth", "latency"):  # fmt: skip
            assert m.sources.get(key), f"{name}: no source for {key}"
        assert "datasheet" in m.sources["peak_flops"]
    a100, h100, h200 = PRESETS["a100"], PRESETS["h100"], PRESETS["h200"]
    assert (a100.peak("bf16"), a100.memory_bandwidth, a100.memory) == (312e12, 2039e9, 80e9)
    assert (h100.peak("bf16"), h100.memory_bandwidth, h100.memory) == (989e12, 3.35e12, 80e9)
    assert h100.peak("fp8") == 1979e12
    assert (h200.memory_bandwidth, h200.memory) == (4.8e12, 141e9)
    # one unit, the datasheets' bytes (GB = 1e9): the H200 holds 141/80 of an H100
    assert h200.memory / h100.memory == pytest.approx(141 / 80)
    b200 = PRESETS["b200"]  # the HGX/DGX B200 datasheets' 8-GPU figures over 8
    assert (b200.peak("bf16"), b200.peak("fp8")) == (36e15 / 2 / 8, 72e15 / 2 / 8)
    assert (b200.memory_bandwidth, b200.memory) == (64e12 / 8, 1440e9 / 8)
    assert b200.intra_node_bandwidth == 14.4e12 / 8 / 2  # per direction
    assert a100.message_time(25e9, same_node=False) == pytest.approx(1 + 10e-6)


def test_machine_files(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"preset": "h100", "gpus_per_node": 4}))
    m = load_machine(str(path))
    assert m.gpus_per_node == 4 and m.memory_bandwidth == PRESETS["h100"].memory_bandwidth
    path.write_text(json.dumps({"peak_flops": {"bf16": 1e15}}))
    with pytest.raises(MachineError, match="missing field"):
        load_machine(str(path))
    path.write_text(json.dumps({"preset": "h100", "warp_drive": 1}))
    with pytest.raises(MachineError, match="unknown field 'warp_drive'"):
        load_machine(str(path))
    with pytest.raises(MachineError, match="gives no peak for fp8"):
        PRESETS["a100"].peak("fp8")
    with pytest.raises(MachineError, match="presets: a100"):
        load_machine("tpu")


@pytest.mark.parametrize(
    ("layers", "stages", "split"),
    [(30, 8, [3, 4, 4, 4, 4, 4, 4, 3]), (46, 24, [1] + [2] * 22 + [1]),
     (62, 64, [0] + [1] * 62 + [0]), (8, 4, [2, 2, 2, 2]), (5, 2, [3, 2]), (3, 1, [3]),
     (9, 4, [2, 2, 3, 2])],
)  # fmt: skip
def test_layer_split_leaves_the_embedding_and_head_stages_short(layers, stages, split):
    assert layer_split(layers, stages) == split


def test_stage_costs_by_hand():
    m = load_machine("a100")
    rates = Rates(1e12, 2e12, 4e12, gemms_only=True)
    c = model_costs(TINY, m, Layout(pp=2, shard="none"), rates)
    measured = model_costs(TINY, m, Layout(pp=2, shard="none"), Rates(1e12, 2e12, 4e12))
    assert measured.f[0] == TINY.layer_flops("F") / 1e12  # whole passes: nothing apart
    assert c.layers == [1, 1]
    bw = m.memory_bandwidth * MEMORY_EFFICIENCY
    # the non-matrix operators' bytes, 12 tokens of width 8 (fp16, no dropout, no flash):
    # F norms 12*8*2*(2*2 + 2*3), activation 12*32*2*2, scores 12*4*2 heads*2*2 = 1920+1536+384
    assert c.f[0] == pytest.approx(TINY.layer_flops("F") / 1e12 + 3840 / bw)
    # I 12*8*2*(2*3 + 2*3) + 12*32*2*3 + 96*3*2 = 5184; the head's norm 96*3*2 and its loss
    # over 12 x 10 logits (4 + 2 bytes each) = 576 + 720
    head_i = (TINY.layer_flops("I") + TINY.head_flops("I")) / 2e12
    assert c.i[1] == pytest.approx(head_i + (5184 + 1296) / bw)
    assert c.w[1] == (TINY.layer_flops("W") + TINY.head_flops("W")) / 4e12
    assert c.saved_bytes[1] == TINY.layer_saved_bytes() + TINY.head_saved_bytes()
    assert c.boundary_s == [5e-6 + TINY.boundary_bytes() / 300e9]  # one node, NVLink
    p0 = TINY.layer_params() + TINY.embedding_params()
    p1 = TINY.layer_params() + TINY.head_params()  # tied, but on another rank: a copy
    assert c.params == [p0, p1]
    assert c.static_bytes == [p0 * (2 + 2 + 12), p1 * (2 + 2 + 12)]  # fp16, unsharded
    assert c.optimizer_step_s == pytest.approx([p0 * ADAM_BYTES["fp16"] / bw,
                                                p1 * ADAM_BYTES["fp16"] / bw])  # fmt: skip


def test_sharding_and_placement_across_nodes():
    a = Arch("a", layers=16, hidden=64, heads=4, seq_len=32, vocab=100)
    m = load_machine("h100")
    inner = model_costs(a, m, Layout(pp=16, dp=2, shard="none"))
    sharded = model_costs(a, m, Layout(pp=16, dp=2, shard="optimizer"))
    n = inner.params[1]
    assert inner.static_bytes[1] == n * (2 + 4 + 12)
    assert sharded.static_bytes[1] == n * (2 + 4 + 12 / 2)
    assert sharded.optimizer_step_s[1] == pytest.approx(inner.optimizer_step_s[1] / 2)
    # pipeline ranks on consecutive GPUs: the boundary between ranks 7 and 8 crosses nodes
    slow = m.message_time(a.boundary_bytes(), same_node=False)
    fast = m.message_time(a.boundary_bytes(), same_node=True)
    assert inner.boundary_s[7] == slow and inner.boundary_s[6] == fast
    # replicas inner: rank r of both replicas on GPUs 2r, 2r+1; ranks 3 and 4 span nodes
    apart = model_costs(a, m, Layout(pp=16, dp=2, pp_inner=False))
    assert apart.boundary_s[3] == slow and apart.boundary_s[2] == fast


def test_v_placement_holds_the_tied_embedding_once_and_skips_its_all_reduce():
    a = Arch("a", layers=6, hidden=64, heads=4, seq_len=32, vocab=100)
    m = load_machine("h100")
    v = model_costs(a, m, Layout(pp=4, stages_per_rank=2, placement="v"))
    loop = model_costs(a, m, Layout(pp=4))
    assert v.params[0] == v.layers[0] * a.layer_params() + v.layers[7] * a.layer_params() + (
        a.embedding_params())  # fmt: skip
    assert v.iteration_costs().tail == [0.0] * 4
    assert loop.iteration_costs().tail[0] > 0 and loop.iteration_costs().tail[3] > 0


def test_activation_peaks_follow_the_program():
    s = make_schedule("1f1b", 4, 8)
    assert activation_peaks(s, [1.0] * 4, [0.0] * 4) == [4, 3, 2, 1]
    z = make_schedule("zb-h1", 4, 8)
    held = activation_peaks(z, [1.0] * 4, [0.0] * 4)
    freed = activation_peaks(z, [1.0] * 4, [0.5] * 4)
    assert all(f <= h for f, h in zip(freed, held, strict=True)) and freed != held
    # ranks of unequal programs: rank 0 runs full backwards, rank 1 splits them
    rows = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1I0", "1F1", "1W0", "1I1", "1W1"]]
    mixed = Schedule(2, 2, 2, {0: 0, 1: 1}, actions_from_strings(rows))
    assert activation_peaks(mixed, [3.0, 2.0], [1.0, 1.5]) == [6.0, 2.5]
    with pytest.raises(ModelCostError, match="one figure per stage"):
        activation_peaks(mixed, [3.0], [1.0])


def test_boundary_time_replaces_the_link_per_boundary():
    s = make_schedule("gpipe", 3, 1)
    base = simulate(s, CostModel(f=1, b=1, w=0)).makespan
    slow = simulate(s, CostModel(f=1, b=1, w=0, boundary_time=[0.0, 5.0])).makespan
    assert slow == base + 2 * 5.0  # the second boundary forward and back


def test_iteration_end_sync_against_post_validated():
    s = make_schedule("1f1b", 2, 2)
    r = simulate(s, CostModel(f=1, b=1, w=1))
    sync = iteration(r.columns, 2, IterationCosts([3.0, 5.0], [1.0, 0.0], sync=2.0))
    assert sync.pipeline == r.makespan
    assert sync.time == max(r.makespan + 1.0, r.makespan) + 2.0 + 5.0
    post = iteration(r.columns, 2, IterationCosts([3.0, 5.0], [1.0, 0.0], sync=2.0,
                                                  post_validated=True))  # fmt: skip
    starts = [0.0, 1.0]  # rank 1's first F waits for rank 0's
    ends = [r.makespan, r.makespan - 1.0]
    assert post.time == max(ends[0] + 1.0 - starts[0] + 3.0, ends[1] - starts[1] + 5.0)
    assert math.isclose(post.start[1], 1.0)


def test_measured_rates_reproduce_the_measured_times():
    a = TINY.with_microbatch(2)
    rates = Rates.measured(a, 3, True, [1e-3, 2e-3, 1.5e-3], "run")
    c = model_costs(a, load_machine("a100"), Layout(pp=1), rates)
    assert c.layers == [2]  # TINY has 2 layers; 3 were measured: rates scale by FLOPs
    ratio = (2 * a.layer_flops("F") + a.head_flops("F")) / (3 * a.layer_flops("F")
                                                            + a.head_flops("F"))  # fmt: skip
    assert np.isclose(c.f[0], 1e-3 * ratio)


def test_rates_from_a_calibrated_gpt_run():
    from types import SimpleNamespace

    from vpipe.predict.plan import PlanError
    from vpipe.predict.run_rates import calibrated_rates, run_arch

    meta = {"model": "gpt", "stages": 2, "host": "h",
            "sizes": {"vocab": 64, "d_model": 32, "n_heads": 2, "n_layers": 2, "seq_len": 8}}
    arch = run_arch(meta, 4)
    assert (arch.layers, arch.hidden, arch.microbatch, arch.precision) == (2, 32, 4, "fp32")
    # 4 pieces (embedding, 2 blocks, head) on 2 stages: [embedding, block], [block, head]
    cal = SimpleNamespace(f=np.array([10.0, 30.0]), b=np.array([20.0, 40.0]),
                          w=np.array([5.0, 15.0]), n_stages=2)  # fmt: skip
    rates = calibrated_rates(SimpleNamespace(calibration=cal, pieces=4, rows=4), meta, "r1")
    f = 2 * arch.layer_flops("F") + arch.head_flops("F")
    assert rates.f == pytest.approx(f / 40e-6)
    assert rates.w == pytest.approx((2 * arch.layer_flops("W") + arch.head_flops("W")) / 20e-6)
    assert "run r1" in rates.source
    with pytest.raises(PlanError, match="needs a run of the gpt model"):
        run_arch({"model": "mlp"}, 4)


@pytest.mark.parametrize("inner", [True, False])
@pytest.mark.parametrize(("pp", "dp", "tp"), [(4, 2, 1), (16, 2, 1), (4, 4, 2), (2, 8, 4),
                                               (8, 1, 16)])  # fmt: skip
def test_node_checks_agree_with_each_gpu(pp, dp, tp, inner):
    lay = Layout(pp=pp, dp=dp, tp=tp, pp_inner=inner)
    gpn = 8

    def nodes(rank):  # the node of every GPU of the rank's group, per replica
        return [[(lay.gpu(rank, d) + k) // gpn for k in range(lay.group)] for d in range(dp)]

    pairs = [(a, b) for a in range(pp) for b in range(pp)]
    want = [tp <= gpn and all(x[0] == y[0] for x, y in zip(nodes(a), nodes(b), strict=True))
            for a, b in pairs]  # fmt: skip
    got = lay.same_nodes([a for a, _ in pairs], [b for _, b in pairs], gpn)
    assert got.tolist() == want
    assert [lay.same_node(a, b, gpn) for a, b in pairs] == want
    one = all(len({n for g in nodes(r) for n in g}) == 1 for r in range(pp))
    assert lay.all_replicas_in_one_node(gpn) == one


@pytest.mark.parametrize("hidden", [0.0, 0.5, 1.0])
def test_tp_collectives_are_charged_less_the_fitted_hidden_share(hidden):
    """The share of TP's collectives a fit says runs under the GEMMs is all that is taken
    off: with none hidden F pays them whole, with all hidden nothing."""
    from dataclasses import replace

    from vpipe.sim.efficiency import FITS

    a = Arch("a", layers=4, hidden=256, heads=8, seq_len=128, vocab=100)
    m = load_machine("h100")

    def tp_s(share: float) -> float:
        fit = replace(FITS["h100"], tp_hidden=share)
        return model_costs(a, m, Layout(pp=1, tp=4), fit=fit).extra["parts"]["F"][0]["tp"]

    whole = tp_s(0.0)
    assert whole > 0
    assert tp_s(hidden) == pytest.approx(whole * (1 - hidden))


@pytest.mark.parametrize(("hidden", "seq", "capped_by"), [(256, 128, "gemm"), (8192, 4096, "comm")])
def test_a_fused_backward_hides_i_collectives_under_the_column_matrices_w_gemms(
    hidden, seq, capped_by
):
    """B = I + W less, for QKV and the MLP's input matrix each, the smaller of its half of
    I's TP collectives and its weight-gradient GEMM: a small block's GEMMs are shorter than
    the collectives (the GEMMs' time is hidden), a large block's longer (all of I's own
    collectives are); without asynchronous TP communication B is I + W."""
    from dataclasses import replace

    from vpipe.sim.efficiency import FITS

    a = Arch("a", layers=4, hidden=hidden, heads=8, seq_len=seq, vocab=100)
    m = load_machine("a100")
    fit = replace(FITS["a100"], tp_hidden=0.0)
    c = model_costs(a, m, Layout(pp=2, tp=4), fit=fit)
    comm_per_pass = c.extra["parts"]["F"][0]["tp"] / 2  # stage 0: 2 blocks
    t, tp = a.tokens, 4
    qkv_s = 2 * t * hidden * 3 * hidden / tp / c.rates.w
    mlp_s = 2 * t * hidden * 4 * hidden / tp / c.rates.w
    per_block = {"gemm": qkv_s + mlp_s, "comm": comm_per_pass}[capped_by]
    assert min(comm_per_pass / 2, qkv_s) + min(comm_per_pass / 2, mlp_s) == pytest.approx(
        per_block)
    for s in range(2):
        assert c.b[s] == pytest.approx(c.i[s] + c.w[s] - 2 * per_block)
        assert c.cost_model().per_stage[s]["B"] == pytest.approx(c.b[s] * 1e6)
    apart = model_costs(a, m, Layout(pp=2, tp=4, overlap_tp_backward=False), fit=fit)
    assert apart.b == [i + w for i, w in zip(apart.i, apart.w, strict=True)]
    assert "B" not in apart.cost_model().per_stage[0]
    one = model_costs(a, m, Layout(pp=2, tp=1), fit=fit)  # no TP, nothing to hide
    assert "B" not in one.cost_model().per_stage[0]
