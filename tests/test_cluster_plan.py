"""`vpipe plan --arch --machine --gpus`: candidates are reproduced by costing them directly;
the ranking moves the way the memory budget and the link figures say it should; a plan
nothing fits, or a split that cannot work, is one line; ties are those within the machine's
measured error, and a machine without one says its error is unknown."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from vpipe.cli import main
from vpipe.predict.cluster import ClusterSpec, plan_cluster, rank_candidates, tie_band
from vpipe.predict.cluster_eval import PROBE, ClusterCandidate
from vpipe.predict.plan import PlanError
from vpipe.schedules import catalogue
from vpipe.sim import simulate
from vpipe.sim.activation_memory import activation_peaks
from vpipe.sim.arch import Arch
from vpipe.sim.collectives import simulate_reductions
from vpipe.sim.efficiency import FITS
from vpipe.sim.iteration import iteration
from vpipe.sim.machine import GIB, load_machine
from vpipe.sim.model_costs import Layout, model_costs

ARCH = Arch("small", layers=16, hidden=2048, heads=16, seq_len=2048, vocab=32000)
H100 = load_machine("h100")
SCHEDULES = ("1f1b", "zbv", "v-min")


def spec(budget_gib: float, machine=H100, **kw) -> ClusterSpec:
    kw = {"tp": 1, "cp": 1, "recompute": "none", **kw}
    return ClusterSpec(ARCH, machine, 16, 128, budget_gib * GIB, schedules=SCHEDULES,
                       microbatch_sizes=(1,), **kw)  # fmt: skip


@pytest.mark.parametrize(("tp", "cp", "recompute"), [(1, 1, "none"), (2, 2, "selective"),
                                                    (4, 1, "full")])  # fmt: skip
def test_a_candidate_is_what_its_costs_simulate_to(tp, cp, recompute):
    result = plan_cluster(spec(80, tp=tp, cp=cp, recompute=recompute))
    c = result["recommended"]
    assert (c["tp"], c["cp"], c["recompute"]) == (tp, cp, recompute)
    fam = catalogue.get(c["schedule"])
    layout = Layout(c["pp"], c["dp"], c["stages_per_rank"], fam.placement, tp=tp, cp=cp,
                    recompute=recompute)  # fmt: skip
    costs = model_costs(ARCH.with_microbatch(c["microbatch_size"]), H100, layout)
    s = fam.generator(c["pp"], c["microbatches"], c["stages_per_rank"])
    r = simulate(s, costs.cost_model())
    red = None
    if c["dp"] > 1:
        red = simulate_reductions(s, r.columns, r.makespan, *costs.dp_reduction(),
                                  within_backward=layout.overlap_grad_reduce)  # fmt: skip
    seconds = iteration(r.columns, c["pp"], costs.iteration_costs(), red).time / 1e6
    assert c["tokens_per_s_per_gpu"] == pytest.approx(128 * 2048 / seconds / 16)
    # MFU: the model's F, I and W of every sequence over the GPUs' peak; HFU adds the recompute
    model = 128 * ARCH.model_flops() / c["microbatch_size"]
    assert c["mfu"] == pytest.approx(model / (H100.peak("bf16") * 16 * seconds))
    assert (c["hfu"] > c["mfu"]) == (recompute != "none")
    peaks = activation_peaks(s, costs.alloc_bytes, costs.freed_by_i)
    need = max(a + b + p for a, b, p in zip(costs.static_bytes, costs.transient_bytes, peaks,
                                            strict=True))  # fmt: skip
    mem = c["memory_bytes"]
    assert mem["total"] == pytest.approx(need)
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    assert sum(c["step_shares"].values()) == pytest.approx(1.0)
    # the H100's fitted terms hide TP's collectives entirely (tp_hidden 1): none exposed
    tp_exposed = tp > 1 and FITS["h100"].tp_hidden < 1
    assert (c["step_shares"]["tp"] > 0) == tp_exposed
    assert (c["step_shares"]["recompute"] > 0) == (recompute != "none")
    speeds = [x["tokens_per_s_per_gpu"] for x in result["candidates"]]
    assert speeds == sorted(speeds, reverse=True)
    assert all(x["memory_bytes"]["total"] <= 80 * GIB for x in result["candidates"])


def test_a_tighter_memory_budget_moves_the_plan_to_a_smaller_schedule():
    roomy = plan_cluster(spec(6))["candidates"][0]
    tight = plan_cluster(spec(4))["candidates"][0]
    assert roomy["memory_bytes"]["total"] > 4 * GIB  # the fastest no longer fits ...
    assert tight["memory_bytes"]["total"] <= 4 * GIB  # ... so the next fastest that does leads
    assert tight["tokens_per_s_per_gpu"] < roomy["tokens_per_s_per_gpu"]
    assert tight["memory_bytes"]["activations"] < roomy["memory_bytes"]["activations"]


def test_recomputation_fits_what_does_not_fit_without_it():
    """Full recomputation keeps one input per block: it fits a budget that no schedule fits
    with every activation kept, and costs a forward more per microbatch."""
    def tight(recompute: str) -> ClusterSpec:
        return replace(spec(5, recompute=recompute), microbatch_sizes=(2,), schedules=("1f1b",))

    with pytest.raises(PlanError, match="nothing fits"):
        plan_cluster(tight("none"))
    full = plan_cluster(tight("full"))["recommended"]
    assert full["memory_bytes"]["total"] <= 5 * GIB and full["hfu"] > full["mfu"]


def test_a_slow_link_between_nodes_moves_the_plan_to_fewer_replicas():
    fast = plan_cluster(spec(80))["candidates"][0]
    slow_machine = replace(H100, inter_node_bandwidth=H100.inter_node_bandwidth / 100)
    slow = plan_cluster(spec(80, slow_machine))["candidates"][0]
    # the replicas' gradient all-reduce crosses nodes: fewer replicas, less of it
    assert slow["dp"] < fast["dp"]
    assert slow["tokens_per_s_per_gpu"] < fast["tokens_per_s_per_gpu"]
    # a faster link inside a node changes nothing that crosses nodes only
    quick = replace(slow_machine, intra_node_bandwidth=H100.intra_node_bandwidth * 2)
    assert plan_cluster(spec(80, quick))["candidates"][0]["dp"] == slow["dp"]


def test_nothing_fits_is_one_line_naming_the_least_need():
    with pytest.raises(PlanError, match=r"nothing fits 1.0 GiB per GPU: the least any candidate"
                       r" needs is [0-9.]+ GiB or more \(") as e:  # fmt: skip
        plan_cluster(spec(1))
    assert "\n" not in str(e.value)


def test_ties_are_within_the_machines_error_and_the_least_memory_is_recommended():
    band, why = tie_band(H100)
    assert 0 < band < 1 and "measured error" in why

    def cand(name, speed, mem):
        return ClusterCandidate(name, 1, 4, 1, 1, "optimizer", "none", 1, 1, 8, {"total": mem},
                                speed)  # fmt: skip

    found = [cand("a", 100.0, 9.0), cand("b", 100.0 * (1 - band / 2), 5.0),
             cand("c", 100.0 * (1 - 2 * band), 1.0)]  # fmt: skip
    ranked, best = rank_candidates(found, band)
    assert [c.schedule for c in ranked] == ["a", "b", "c"]
    assert [c.tied for c in ranked] == [True, True, False]
    assert best.schedule == "b"


@pytest.mark.parametrize("name", ["h200", "b200"])
def test_a_machine_without_published_runs_says_its_error_is_unknown(name):
    band, why = tie_band(load_machine(name))
    assert "unknown" in why and band == max(tie_band(H100)[0], tie_band(load_machine("a100"))[0])


@pytest.mark.parametrize("name", [f.name for f in catalogue.families() if f.name != "auto"])
def test_more_microbatches_never_lower_a_familys_peak(name):
    """What the planner's probe relies on: a family's peak at PROBE x stages microbatches is
    at most its peak with more."""
    fam = catalogue.get(name)
    for ranks in (2, 4):
        try:
            first = fam.generator(ranks, PROBE * ranks * fam.stages_per_rank, None)
        except Exception:
            continue
        n = first.n_stages
        alloc, freed = [1.0 + s % 3 for s in range(n)], [0.4 * (1.0 + s % 3) for s in range(n)]
        low = activation_peaks(first, alloc, freed)
        for m in (first.n_microbatches + 1, 2 * first.n_microbatches + 3):
            more = activation_peaks(fam.generator(ranks, m, None), alloc, freed)
            assert all(a <= b + 1e-9 for a, b in zip(low, more, strict=True)), (ranks, m)


def write_arch(tmp_path) -> str:
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"layers": 16, "hidden": 2048, "heads": 16, "seq_len": 2048,
                                "vocab": 32000}))  # fmt: skip
    return str(path)


def test_cli_plans_a_cluster_as_json(tmp_path, capsys):
    arch = write_arch(tmp_path)
    assert main(["plan", "--arch", arch, "--machine", "h100", "--gpus", "16", "--batch", "128",
                 "--schedules", "1f1b,zbv", "--microbatch-sizes", "1,2", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["machine"] == "h100" and out["gpus"] == 16
    assert "of h100's bf16 peak" in out["rates"]["source"]
    rec = out["recommended"]
    for key in ("tp", "pp", "cp", "dp", "shard", "recompute", "schedule", "stages_per_rank",
                "microbatch_size", "microbatches", "tokens_per_s_per_gpu", "mfu", "memory_bytes"):
        assert key in rec, key
    assert rec["tp"] * rec["cp"] * rec["pp"] * rec["dp"] == 16 and rec["fits"] and rec["tied"]
    assert {c["microbatch_size"] for c in out["candidates"]} == {1, 2}
    assert main(["plan", "--arch", arch, "--machine", "h100", "--gpus", "16", "--batch", "128",
                 "--schedules", "1f1b", "--efficiency", "0.5,0.5,0.5"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "--efficiency 0.5,0.5,0.5" in text and "recommended (of the tied" in text
    assert "layers per stage: " in text


def test_layers_per_stage_are_said_with_their_runs():
    from vpipe.commands._cluster_plan import _runs

    assert _runs([1] + [2] * 62 + [1]) == "1, 2 x 62, 1"
    assert _runs([4, 4]) == "4 x 2"


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--ranks", "4"], "--ranks is not a cluster plan's flag"),
     (["--memory", "6units"], "not units"), (["--efficiency", "2,1,1"], "in \\(0, 1\\]"),
     (["--microbatch-sizes", "0"], ">= 1"), (["--i-frees", "1.5"], "between 0 and 1"),
     (["--gpus", "24", "--tp", "3"], "tp=3 does not divide small's 16 heads"),
     (["--tp", "4", "--pp", "8"], "--gpus 16 is not divisible by tp=4 x pp=8 = 32"),
     (["--cp", "0"], "--cp must be >= 1")],
)  # fmt: skip
def test_cli_refuses_bad_cluster_flags(tmp_path, capsys, extra, message):
    argv = ["plan", "--arch", write_arch(tmp_path), "--machine", "h100", "--gpus", "16",
            "--batch", "128", *extra]  # fmt: skip
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert re.search(message, err), err


def test_cli_without_machine_says_so(tmp_path, capsys):
    assert main(["plan", "--arch", write_arch(tmp_path), "--gpus", "4", "--batch", "8"]) != 0
    assert "give --machine" in capsys.readouterr().err


@pytest.mark.parametrize("name", [f.name for f in catalogue.families() if not f.cost_adapted])
def test_many_microbatches_extend_linearly_from_two_smaller_counts(name):
    """What the planner's extension relies on: past its warm-up a family's iteration time,
    bubble and peak grow linearly with M, so the extended candidate is the simulated one."""
    from vpipe.predict.cluster_eval import EXTEND, _timed, evaluate

    fam = catalogue.get(name)
    v = fam.stages_per_rank
    costs = model_costs(ARCH, H100, Layout(4, 2, v, fam.placement))
    m = 2 * EXTEND * 4 * v + 4
    cand = evaluate(costs, fam, m, 2 * m, 1e15, False)
    whole = fam.generator(4, m, v)
    it, sim = _timed(costs, whole, False)
    assert cand.iteration_s == pytest.approx(it.time / 1e6, rel=1e-9)
    assert cand.bubble == pytest.approx(sim.bubble_ratio, rel=1e-9)
    peaks = activation_peaks(whole, costs.alloc_bytes, costs.freed_by_i)
    static = [sum(p.values()) for p in costs.extra["memory"]]
    assert cand.memory_bytes["total"] == pytest.approx(max(a + b for a, b in zip(static, peaks,
                                                                            strict=True)))  # fmt: skip


def test_a_split_backward_pays_the_tp_collectives_a_fused_one_hides():
    """With asynchronous TP communication 1f1b's fused backwards get faster and its TP share
    smaller; zb-h1 runs I and W apart, so neither moves."""
    from vpipe.predict.cluster_eval import evaluate

    a100 = load_machine("a100")
    fit = replace(FITS["a100"], tp_hidden=0.0)
    got = {}
    for overlap in (True, False):
        layout = Layout(4, tp=8, overlap_tp_backward=overlap)
        costs = model_costs(ARCH, a100, layout, fit=fit)
        for name in ("1f1b", "zb-h1"):
            got[name, overlap] = evaluate(costs, catalogue.get(name), 8, 8, 1e15, False)
    fused, apart = got["1f1b", True], got["1f1b", False]
    assert fused.iteration_s < apart.iteration_s
    assert fused.step_shares["tp"] * fused.iteration_s < apart.step_shares["tp"] * apart.iteration_s
    assert got["zb-h1", True].iteration_s == got["zb-h1", False].iteration_s
    assert got["zb-h1", True].step_shares == got["zb-h1", False].step_shares


def test_cli_says_what_the_runtime_overlaps_and_costs_it(tmp_path, capsys):
    """--grad-reduce after and --tp-backward after-w reach the layout: the same fixed layout
    is slower with either, and the plan says which it assumed."""
    arch = write_arch(tmp_path)
    base = ["plan", "--arch", arch, "--machine", "a100", "--gpus", "32", "--batch", "64",
            "--tp", "8", "--pp", "2", "--dp", "2", "--recompute", "none", "--schedules", "1f1b",
            "--microbatch-sizes", "1", "--json"]  # fmt: skip
    got = {}
    for extra in ([], ["--grad-reduce", "after"], ["--tp-backward", "after-w"]):
        assert main(base + extra) == 0
        out = json.loads(capsys.readouterr().out)
        got[tuple(extra)] = out
    default = got[()]
    assert (default["grad_reduce"], default["tp_backward"]) == ("during", "beside-w")
    after = got["--grad-reduce", "after"]
    apart = got["--tp-backward", "after-w"]
    assert after["grad_reduce"] == "after" and apart["tp_backward"] == "after-w"
    speed = lambda o: o["recommended"]["tokens_per_s_per_gpu"]  # noqa: E731
    assert speed(after) < speed(default) and speed(apart) < speed(default)


@pytest.mark.parametrize("extra", [["--tp", "2"], ["--shard", "full"], ["--grad-reduce", "after"],
                                   ["--tp-backward", "after-w"], ["--microbatch-sizes", "2"]])
def test_a_plan_from_costs_refuses_a_cluster_flag_in_one_line(capsys, extra):
    argv = ["plan", "-p", "2", "-m", "4", "--batch", "8", "--memory", "6units", "--cost",
            "f=1,b=1,w=1", *extra]  # fmt: skip
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{extra[0]} plans a cluster" in err, err
