"""torch.distributed.pipelining baseline: same modules, same gradients as the reference and as
vpipe's runtime, also with activation recomputation (torch's checkpointing; vpipe's own).
One spawn of two gloo ranks runs every configuration."""

import pytest
import torch

from vpipe.baselines import TORCH_SCHEDULES, torch_placement
from vpipe.errors import ScheduleError
from vpipe.sweep.harness import check_against_reference

TINY = {
    "mlp": {"d_model": 16, "d_hidden": 32},
    "tuple": {"d_model": 16, "d_hidden": 24},
    "gpt": {"vocab": 40, "d_model": 16, "n_heads": 2, "seq_len": 8},
}

# (schedule, model, stages per rank, microbatches, recompute)
CONFIGS = [
    ("zbv", "mlp", 2, 4, "none"),
    ("dualpipev", "tuple", 2, 4, "none"),
    ("interleaved-1f1b", "gpt", 2, 4, "none"),
    ("1f1b", "tuple", 1, 3, "none"),
    ("zbv", "gpt", 2, 4, "full"),
    ("1f1b", "gpt", 1, 4, "selective"),
    ("interleaved-1f1b", "mlp", 2, 4, "full"),
]


def _run_both(rank, n_ranks, configs, run_config):
    from vpipe.baselines.torch_pp import TorchPipeline
    from vpipe.commands.run import run_rank
    from vpipe.ir.lowering import lower
    from vpipe.models import build_model
    from vpipe.runtime import Pipeline
    from vpipe.schedules import make_schedule

    out = []
    for name, model_name, v, m, recompute in configs:
        n_stages = n_ranks * v
        schedule = lower(make_schedule(name, n_ranks, m, v))
        grads, losses_by_impl, findings = {}, {}, []
        for impl in ("torch", "vpipe"):
            model = build_model(model_name, n_stages, seed=5, **TINY[model_name])
            reference = model.reference_model()
            mine = sorted(
                s for s, r in torch_placement(name, n_ranks, n_stages).items() if r == rank
            )
            assert mine == schedule.stages_of(rank)
            modules = {s: model.stages[s] for s in mine}
            if impl == "torch":
                pipe = TorchPipeline(
                    name, modules, model.loss_fn, n_stages=n_stages, n_microbatches=m,
                    recompute=recompute,
                )
            else:
                pipe = Pipeline(
                    schedule, modules=modules, loss_fn=model.loss_fn, recompute=recompute
                )
            x, y = model.make_batch(2 * m, seed=1)
            for _ in range(2):  # the second step runs with cached shapes
                for mod in modules.values():
                    mod.zero_grad(set_to_none=True)
                losses = pipe.step(x if 0 in mine else None, y if n_stages - 1 in mine else None)
            findings += [
                (impl, f)
                for f in check_against_reference(reference, model, mine, losses, x, y, m, 1e-5)
            ]
            grads[impl] = {
                (s, n): p.grad.clone() for s in mine for n, p in modules[s].named_parameters()
            }
            losses_by_impl[impl] = None if losses is None else [float(t) for t in losses]
        same = all(
            torch.allclose(grads["torch"][k], grads["vpipe"][k], rtol=1e-5, atol=1e-7)
            for k in grads["torch"]
        )
        out.append(
            {
                "config": (name, model_name, v, m, recompute),
                "findings": findings,
                "losses": losses_by_impl,
                "grads_equal": same and grads["torch"].keys() == grads["vpipe"].keys(),
            }
        )
    import torch.distributed.pipelining as pp

    missing = [
        spec.class_name for spec in TORCH_SCHEDULES.values() if not hasattr(pp, spec.class_name)
    ]
    return out, run_rank(rank, n_ranks, run_config), missing


def test_torch_baseline_matches_reference_and_vpipe():
    from vpipe.cli import build_parser
    from vpipe.commands.run import build_config
    from vpipe.runtime.launch import spawn

    argv = "run interleaved-1f1b -p 2 -m 4 --batch 8 --steps 2 --model tuple --impl torch --check"
    args = build_parser().parse_args([*argv.split(), "--sizes", "d_model=16,d_hidden=24"])
    per_rank = spawn(_run_both, 2, CONFIGS, build_config(args), timeout_s=240)
    # `vpipe run --impl torch --check` on the same ranks: every rank saw the check pass
    assert per_rank[0][2] == [], "torch lacks these schedule classes"
    runs = [r[1] for r in per_rank]
    assert all(r["ok"] and r["checked"] > 0 for r in runs), runs
    assert len(runs[1]["losses"]) == 4 and runs[0]["losses"] is None  # loop: loss on rank 1
    assert all(len(r["step_times_s"]) == 2 for r in runs)
    for rank, (results, _, _) in enumerate(per_rank):
        for res in results:
            name = res["config"][0]
            bad = [(impl, f) for impl, f in res["findings"] if not f["ok"]]
            assert not bad, (rank, res["config"], bad)
            assert res["findings"], res["config"]  # something was compared
            assert res["grads_equal"], (rank, res["config"])
            loss_rank = 0 if TORCH_SCHEDULES[name].style == "v" else 1
            if rank == loss_rank:
                t, v = res["losses"]["torch"], res["losses"]["vpipe"]
                assert t is not None and len(t) == res["config"][3]
                assert t == pytest.approx(v, rel=1e-6)
            else:
                assert res["losses"] == {"torch": None, "vpipe": None}


def test_torch_refuses_selective_checkpointing_under_a_split_backward():
    from vpipe.runtime.launch import spawn

    with pytest.raises(Exception, match="splits the backward .* selective checkpointing"):
        spawn(_torch_selective_zbv, 2, timeout_s=120)


def _torch_selective_zbv(rank, n_ranks):
    from vpipe.baselines.torch_pp import TorchPipeline
    from vpipe.models import build_model

    model = build_model("mlp", 4, seed=5, **TINY["mlp"])
    mine = [s for s, r in torch_placement("zbv", n_ranks, 4).items() if r == rank]
    TorchPipeline(
        "zbv", {s: model.stages[s] for s in mine}, model.loss_fn, n_stages=4, n_microbatches=4,
        recompute="selective",
    )


def test_torch_placement():
    assert torch_placement("zbv", 2, 4) == {0: 0, 1: 1, 2: 1, 3: 0}
    assert torch_placement("looped-bfs", 2, 4) == {0: 0, 1: 1, 2: 0, 3: 1}
    with pytest.raises(ScheduleError, match="one stage per rank"):
        torch_placement("1f1b", 2, 4)
    with pytest.raises(ScheduleError, match="exactly 2 stages per rank"):
        torch_placement("dualpipev", 2, 8)
    with pytest.raises(ScheduleError, match="no torch.distributed.pipelining schedule"):
        torch_placement("bfs-v", 2, 4)
