"""Bring your own model: a model defined only in this test (written to a temporary module) runs
through `vpipe run --check` and `vpipe bench`, in both styles (blocks, or a whole model with
module names per stage); bad references and bad returns are one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vpipe.cli import main
from vpipe.models import ModelError, build_model

USER_MODULE = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    from vpipe.models.custom import ModelParts


    def _batch(width):
        def make(batch, seed):
            g = torch.Generator().manual_seed(seed)
            return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
        return make


    def stack(width=8, depth=4):
        blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
        return ModelParts(loss_fn=F.mse_loss, make_batch=_batch(width), blocks=blocks)


    class Net(nn.Module):
        def __init__(self, width, depth):
            super().__init__()
            self.body = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
            self.out = nn.Linear(width, width)


    def named(width=8, depth=4, stages=None):
        fqns = [[f"body.{i}" for i in range(depth)] + ["out"]]
        if stages == 2:
            fqns = [[f"body.{i}" for i in range(depth // 2)],
                    [f"body.{i}" for i in range(depth // 2, depth)] + ["out"]]
        if stages == -1:  # forgets the head
            fqns = [[f"body.{i}" for i in range(depth)]]
        if stages == -2:  # one module in two stages
            fqns = [["body.0"], ["body.0", "out"]]
        return ModelParts(loss_fn=F.mse_loss, make_batch=_batch(width), model=Net(width, depth),
                          stage_fqns=fqns)


    def not_parts():
        return nn.Linear(2, 2)
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "vpipe_user_model.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("vpipe_user_model", None)


def test_blocks_split_like_builtin_models(user_module):
    one = build_model("vpipe_user_model:stack", 1, seed=3, depth=4)
    four = build_model("vpipe_user_model:stack", 4, seed=3, depth=4)
    assert four.n_stages == 4 and one.n_stages == 1
    p1 = [p for m in one.stages for p in m.parameters()]
    p4 = [p for m in four.stages for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(p1, p4, strict=True))  # same seed, any split
    x, y = four.make_batch(4, seed=1)
    ref = four.reference_model()
    assert torch.allclose(ref(x), four.stages[3](four.stages[2](four.stages[1](four.stages[0](x)))))


def test_named_modules_per_stage(user_module):
    m = build_model("vpipe_user_model:named", 2, seed=0, stages=2)
    assert [len(list(s.parameters())) for s in m.stages] == [4, 6]


@pytest.mark.parametrize(
    ("name", "sizes", "n_stages", "message"),
    [
        ("vpipe_no_such_module:f", {}, 1, "cannot import 'vpipe_no_such_module'"),
        ("vpipe_user_model:nope", {}, 1, "has no function 'nope'"),
        ("vpipe_user_model:not_parts", {}, 1, "returned Linear, not vpipe.models.custom.ModelParts"),
        ("vpipe_user_model:stack", {"colour": 3}, 1, "calling it with sizes {'colour': 3}"),
        ("vpipe_user_model:named", {}, 2, "stage_fqns names 1 stages, the schedule has 2"),
        ("vpipe_user_model:named", {"stages": -1}, 1, "leave 2 parameters in no stage"),
        ("vpipe_user_model:named", {"stages": -2}, 2, "module 'body.0' in stages 0 and 1"),
        ("vpipe_user_model:stack", {"depth": 2}, 4, "cannot split 2 blocks"),
        (":stack", {}, 1, "expected package.module:function"),
    ],
)
def test_bad_model_is_one_clear_error(user_module, name, sizes, n_stages, message):
    with pytest.raises(ModelError, match=None) as e:
        build_model(name, n_stages, **sizes)
    assert message in str(e.value) and "\n" not in str(e.value)


def _vpipe(args: list[str], path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "vpipe", *args], capture_output=True, text=True, env=env,
        timeout=300, cwd=path,
    )  # fmt: skip


def test_run_and_bench_with_a_user_model(user_module, capsys):
    code = main(["run", "zbv", "-p", "2", "-m", "4", "--batch", "8", "--steps", "2",
                 "--model", "vpipe_user_model:named", "--sizes", "stages=4", "--check"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "stage_fqns names 1 stages" in err  # checked before launch, in process
    r = _vpipe(["run", "zbv", "-p", "2", "-m", "4", "--batch", "8", "--steps", "2",
                "--model", "vpipe_user_model:stack", "--check"], user_module)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "check: OK" in r.stdout and "model=vpipe_user_model:stack" in r.stdout
    out = user_module / "out"
    r = _vpipe(["bench", "--model", "vpipe_user_model:stack", "--schedules", "1f1b,zbv",
                "--microbatches", "2", "--batch", "8", "--impl", "vpipe", "--warmup", "1",
                "--steps", "1", "--rounds", "1", "--timing-precision", "0", "--out", str(out)],
               user_module)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    import pandas as pd

    runs = pd.read_parquet(out / "runs")
    assert set(runs.loc[runs["source"] == "measured", "model"]) == {"vpipe_user_model:stack"}
