"""Activation recomputation (``Pipeline(recompute=...)``): the unpipelined model's losses and
gradients under every schedule family (B, I/W, overlapped F&B) and mode, at P=1 and P=2, a
stage that uses a weight twice included; full recompute runs each stage's forward once more
per microbatch (not twice under a split backward); the saved bytes counted follow the mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_runtime import _one_thread  # noqa: F401 (autouse: one thread per test)
from torch import nn

from vpipe.models import build_model
from vpipe.models.base import BenchModel, split_pieces
from vpipe.runtime import Pipeline
from vpipe.runtime.launch import spawn
from vpipe.runtime.recompute import RECOMPUTE_MODES, lazy
from vpipe.schedules import make_schedule, schedule_names
from vpipe.sweep.harness import reference_step

SIZES = {
    "gpt": {"vocab": 32, "d_model": 16, "n_heads": 2, "seq_len": 8},
    "mlp": {"d_model": 16, "d_hidden": 32},
    "gpt-fused": {"vocab": 32, "d_model": 16, "n_heads": 2, "seq_len": 8, "fused_fb": 1},
}


class TiedBlock(nn.Module):
    """x + lin(gelu(lin(x))): one weight used twice in the stage."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(lazy(F.gelu, self.lin(x)))


def _tied(n_stages: int) -> BenchModel:
    d = 8
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        blocks = [TiedBlock(d) for _ in range(n_stages)]

    def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)

    stages = split_pieces(blocks, n_stages, "tied blocks")
    return BenchModel("tied", stages, lambda o, t: F.mse_loss(o, t), {}, 3, batch)


def _build(model: str, n_stages: int) -> BenchModel:
    if model == "tied":
        bm = _tied(n_stages)
    else:
        bm = build_model(model.removesuffix("-fused"), n_stages, seed=1, **SIZES[model])
    for m in bm.stages:
        m.double()
    return bm


def _batch(bm: BenchModel, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = bm.make_batch(n, seed=0)
    return tuple(t.double() if t.is_floating_point() else t for t in (x, y))


def _reference(model: str, n_stages: int, n_mb: int) -> tuple[list, dict]:
    bm = _build(model, n_stages)
    ref = bm.reference_model()
    losses = reference_step(ref, bm.loss_fn, *_batch(bm, 2 * n_mb), n_mb)
    grads = {(s, k): p.grad for s, m in enumerate(ref.stages) for k, p in m.named_parameters()}
    return losses, grads


def _check(rank: int, name: str, n_ranks: int, model: str, mode: str, ref: tuple) -> dict:
    """One step of ``name`` with ``mode`` on this rank against the reference; its stats."""
    sched = make_schedule(name, n_ranks, 4)
    bm = _build(model, sched.n_stages)
    mine = sched.stages_of(rank)
    pipe = Pipeline(sched, {s: bm.stages[s] for s in mine}, bm.loss_fn, recompute=mode)
    x, y = _batch(bm, 8)
    losses = pipe.step(x if 0 in mine else None, y if sched.loss_stage in mine else None)
    where = f"{name} P={n_ranks} {model} recompute={mode} rank {rank}"
    ref_losses, ref_grads = ref
    if sched.loss_stage in mine:
        for got, want in zip(losses, ref_losses, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=0, msg=where)
    for s in mine:
        for k, p in bm.stages[s].named_parameters():
            torch.testing.assert_close(
                p.grad, ref_grads[s, k], rtol=1e-9, atol=1e-12, msg=f"{where} grad {s}.{k}"
            )
    ex = pipe._executor
    assert ex.leftovers() == 0 and ex.live == 0 and ex.live_bytes == 0, where
    bytes_ = {s: (st.act_bytes, st.recompute_bytes) for s, st in pipe.stages.items()}
    return {**pipe.stats, "stage_bytes": bytes_}


# Every family: B (gpipe, 1f1b, interleaved, looped), I/W (zb-*, zbv, v-*, auto), overlapped
# F&B (dualpipev, whose fused variant runs the stage module's overlapped_forward_backward).
def _configs(n_ranks: int) -> list[tuple[str, str]]:
    if n_ranks == 1:
        models = ("gpt", "mlp", "tied")
        out = [(n, models[i % 3]) for i, n in enumerate(schedule_names())]
        return out + [("dualpipev", "gpt-fused"), ("zbv", "tied"), ("1f1b", "tied")]
    return [("gpipe", "mlp"), ("1f1b", "gpt"), ("interleaved-1f1b", "tied"),
            ("looped-bfs", "gpt"), ("zb-h1", "tied"), ("zb-h2", "mlp"), ("zbv", "gpt"),
            ("zbv", "tied"), ("v-half", "tied"), ("v-min", "gpt"), ("auto", "mlp"),
            ("dualpipev", "gpt-fused")]  # fmt: skip


def _jobs(n_ranks: int) -> list:
    jobs = []
    for name, model in _configs(n_ranks):
        n_stages = make_schedule(name, n_ranks, 4).n_stages
        ref = _reference(model, n_stages, 4)
        jobs += [(name, model, mode, ref) for mode in RECOMPUTE_MODES]
    return jobs


def run_jobs(rank: int, n_ranks: int, jobs: list) -> list[tuple[str, str, str, dict]]:
    return [(n, m, mode, _check(rank, n, n_ranks, m, mode, ref)) for n, m, mode, ref in jobs]


def test_every_family_and_mode_matches_the_reference_on_one_rank():
    stats = {(n, m, mode): s for n, m, mode, s in run_jobs(0, 1, _jobs(1))}
    smaller = 0
    for name, model in _configs(1):
        none, full = stats[name, model, "none"], stats[name, model, "full"]
        assert full["peak_live_activations"] == none["peak_live_activations"], name
        # not always smaller: one live microbatch's recomputation is what none keeps, and a
        # split backward holds it from I to W
        peaks = full["peak_live_activation_bytes"], none["peak_live_activation_bytes"]
        assert peaks[0] <= peaks[1], (name, model, peaks)
        smaller += peaks[0] < peaks[1]
    assert smaller >= len(_configs(1)) // 2


def test_every_family_and_mode_matches_the_reference_on_two_ranks():
    """... and the simulator, given each stage's bytes, predicts each rank's peak count."""
    from vpipe.sim import CostModel, simulate

    results = spawn(run_jobs, 2, _jobs(2), timeout_s=300)
    assert [len(r) for r in results] == [3 * len(_configs(2))] * 2
    for k, (name, model, mode, _) in enumerate(results[0]):
        stage_bytes = {s: b for r in results for s, b in r[k][3]["stage_bytes"].items()}
        act, rec = zip(*(stage_bytes[s] for s in sorted(stage_bytes)), strict=True)
        costs = CostModel(activation_bytes=list(act), recompute_bytes=list(rec))
        got = simulate(make_schedule(name, 2, 4), costs).peak_activation_bytes
        counted = [r[k][3]["peak_live_activation_bytes"] for r in results]
        if model == "gpt-fused":  # its hook may run an overlap's B part first: a lower peak
            assert all(c <= g for c, g in zip(counted, got, strict=True)), (name, mode)
        else:
            assert got == counted, (name, model, mode)


class _Counting(nn.Module):
    """Counts its forward calls with autograd on and off."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = {True: 0, False: 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[torch.is_grad_enabled()] += 1
        return self.inner(x)


@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipev"])
def test_full_recompute_runs_each_forward_once_more(name):
    """F without autograd, then one forward with autograd per microbatch and stage, whether
    the backward is one B, an I and a W, or a part of an overlap action."""
    sched = make_schedule(name, 1, 4)
    bm = _build("mlp", sched.n_stages)
    mods = {s: _Counting(m) for s, m in enumerate(bm.stages)}
    pipe = Pipeline(sched, mods, bm.loss_fn, recompute="full")
    pipe.step(*_batch(bm, 8))  # the first step also infers the shapes
    for mod in mods.values():
        mod.calls = {True: 0, False: 0}
    pipe.step(*_batch(bm, 8))
    for s, mod in mods.items():
        assert mod.calls == {False: 4, True: 4}, (name, s, mod.calls)


def _stage_bytes(mode: str, model: str = "gpt") -> tuple[list[int], list[int]]:
    sched = make_schedule("zbv", 1, 2)
    bm = _build(model, sched.n_stages)
    pipe = Pipeline(sched, dict(enumerate(bm.stages)), bm.loss_fn, recompute=mode)
    pipe.step(*_batch(bm, 4))
    stages = pipe.stages.values()
    return [st.act_bytes for st in stages], [st.recompute_bytes for st in stages]


def test_saved_bytes_follow_the_mode():
    """full keeps the stage's inputs and recomputes the rest; selective recomputes the
    activation functions' outputs (a block's 4*d wide GELU output) and attention's core."""
    none, none_rec = _stage_bytes("none")
    full, full_rec = _stage_bytes("full")
    sel, sel_rec = _stage_bytes("selective")
    d, seq, mb = SIZES["gpt"]["d_model"], SIZES["gpt"]["seq_len"], 2
    hidden = mb * seq * d * 8  # one float64 hidden state of a microbatch
    assert none_rec == [0, 0]
    # stage 0 keeps its int64 token ids (a copy: the microbatch views the whole batch), stage 1
    # a hidden state
    assert full == [mb * seq * 8, hidden]
    # full recomputes everything but the inputs it kept (none counts the batch's token ids)
    assert full[0] + full_rec[0] == none[0] - mb * seq * 8
    assert full[1] + full_rec[1] == none[1]
    bm = _build("gpt", 2)
    for s in range(2):
        blocks = sum(type(p).__name__ == "DecoderBlock" for p in bm.stages[s].pieces)
        assert sel_rec[s] == blocks * 4 * hidden, s
        assert sel[s] < none[s] - sel_rec[s], s  # attention's core saves nothing either


def test_an_unknown_mode_is_named():
    sched = make_schedule("1f1b", 1, 2)
    bm = _build("mlp", 1)
    with pytest.raises(Exception, match="recompute must be one of none, full, selective"):
        Pipeline(sched, {0: bm.stages[0]}, bm.loss_fn, recompute="some")


@pytest.mark.parametrize("name", ["zbv", "interleaved-1f1b", "dualpipev", "zb-h1", "looped-bfs"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_simulator_counts_the_bytes_the_runtime_counts(name, mode):
    """Given each stage's measured bytes (kept by F, held by the recomputing backward), the
    simulator's peak is the runtime's, in program order."""
    from vpipe.sim import CostModel, simulate

    sched = make_schedule(name, 1, 6)
    bm = _build("gpt", sched.n_stages)
    pipe = Pipeline(sched, dict(enumerate(bm.stages)), bm.loss_fn, recompute=mode)
    pipe.step(*_batch(bm, 12))
    stages = [pipe.stages[s] for s in range(sched.n_stages)]
    costs = CostModel(
        activation_bytes=[st.act_bytes for st in stages],
        recompute_bytes=[st.recompute_bytes for st in stages],
        recompute=1.0,
    )
    assert any(st.recompute_bytes for st in stages)
    got = simulate(sched, costs).peak_activation_bytes
    assert got == [pipe.stats["peak_live_activation_bytes"]], (name, mode)


def test_recomputation_costs_a_forward_in_each_b_and_i():
    from vpipe.sim import CostModel

    cm = CostModel.parse("f=2,b=3,w=1,recompute=1,recompute_bytes=5,unit=stage")
    f, b, w = cm.stage_times(2)
    assert list(b) == [5, 5] and list(w) == [1, 1] and list(cm.backward_times(2)) == [6, 6]
    assert list(cm.stage_recompute_bytes(2)) == [5, 5]
    measured_b = CostModel(f=2, b=3, w=1, recompute=0.5, per_stage={0: {"B": 3.5}})
    assert list(measured_b.backward_times(2)) == [4.5, 5.0]


def test_plan_weighs_schedule_and_recomputation_under_a_budget():
    """Costs calibrated without recomputation (here: simulated events of a zbv GPT run) give
    each mode's candidates: full holds less and costs a forward more per B and I; a budget
    that no candidate without recomputation fits recommends one that recomputes."""
    from vpipe.predict.plan import Budget, PlanError, calibrated_costs, plan
    from vpipe.sim import CostModel, simulate

    zbv = make_schedule("zbv", 2, 4)
    events = simulate(zbv, CostModel(f=100, b=90, w=70, comm_latency=5)).to_events("r", zbv)
    sizes = {"vocab": 512, "d_model": 128, "n_heads": 4, "n_layers": 4, "seq_len": 64}
    meta = {"model": "gpt", "sizes": sizes, "batch": 32, "stages": 4, "dtype": "fp32"}
    costs = calibrated_costs(events, {0: 8e6, 1: 14e6}, zbv, meta)
    kw = {"microbatches": [8], "schedules": ["zbv", "1f1b"]}
    wide = plan(costs, 2, 32, Budget(1e12), recompute=("none", "full", "selective"), **kw)
    got = {(c["schedule"], c["stages_per_rank"], c["recompute"]): c for c in wide["candidates"]}
    for (name, v, mode), c in got.items():
        none = got[name, v, "none"]
        if mode == "full":
            assert c["predicted_step_s"] > none["predicted_step_s"] * 1.2, name
            assert max(c["peak_activation_bytes"]) < 0.7 * max(none["peak_activation_bytes"])
        if mode == "selective":
            assert max(c["peak_activation_bytes"]) < max(none["peak_activation_bytes"])
    smallest_none = min(max(c["peak_activation_bytes"]) for k, c in got.items() if k[2] == "none")
    tight = plan(costs, 2, 32, Budget(0.9 * smallest_none), recompute=("none", "full"), **kw)
    assert tight["recommended"]["recompute"] == "full"
    with pytest.raises(PlanError, match="nothing fits"):
        plan(costs, 2, 32, Budget(0.9 * smallest_none), **kw)


def test_plan_refuses_recomputation_without_a_calibrated_run():
    from vpipe.errors import VpipeError
    from vpipe.predict.plan import Budget, SpecCosts, plan

    with pytest.raises(VpipeError, match="--recompute full needs costs calibrated on a run"):
        plan(SpecCosts.parse("f=1,b=1,w=1"), 2, 8, Budget(1e12, units=False),
             recompute=("full",), microbatches=[4], schedules=["1f1b"])  # fmt: skip


def test_run_records_the_mode_and_a_bad_one_is_named():
    from vpipe.cli import build_parser
    from vpipe.commands.run import build_config
    from vpipe.errors import VpipeError
    from vpipe.sweep.harness import RankSpec

    argv = "run zbv -p 2 -m 4 --batch 8 --model gpt --recompute selective".split()
    config = build_config(build_parser().parse_args(argv))
    assert config.rank.recompute == "selective" and config.meta["recompute"] == "selective"
    with pytest.raises(VpipeError, match="unknown --recompute 'some': choose from none, full"):
        RankSpec(make_schedule("zbv", 2, 4), recompute="some").check(build=False)
