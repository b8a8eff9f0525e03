import math

import pytest
import torch

from vpipe.errors import VpipeError
from vpipe.models import ModelError, build_model, model_names

SMALL = {
    "mlp": {"d_model": 16, "d_hidden": 32, "n_blocks": 4},
    "gpt": {"vocab": 50, "d_model": 16, "n_heads": 2, "n_layers": 2, "seq_len": 8},
    "tuple": {"d_model": 16, "d_hidden": 24, "n_blocks": 4, "n_buckets": 3},
    "looped-mlp": {"d_model": 16, "d_hidden": 32, "n_blocks": 4, "loops": 2},
}


def flat_params(model):
    """Parameters in stage order, independent of how the model is split."""
    return [p.detach().clone() for m in model.stages for p in m.parameters()]


def run_stages(stages, x):
    for s in stages:
        x = s(*x) if isinstance(x, tuple) else s(x)
    return x


@pytest.mark.parametrize("name", sorted(SMALL))
def test_parameters_depend_on_seed_not_split(name):
    one = build_model(name, 1, seed=3, **SMALL[name])
    for n in (2, 4):
        other = build_model(name, n, seed=3, **SMALL[name])
        assert len(other.stages) == n
        a, b = flat_params(one), flat_params(other)
        assert len(a) == len(b)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    different = build_model(name, 1, seed=4, **SMALL[name])
    assert not all(
        torch.equal(x, y) for x, y in zip(flat_params(one), flat_params(different), strict=True)
    )
    assert one.n_params == sum(p.numel() for p in flat_params(one)) > 0


@pytest.mark.parametrize("name", sorted(SMALL))
def test_reference_matches_stages_and_maps_gradients(name):
    model = build_model(name, 4, seed=1, **SMALL[name])
    x, y = model.make_batch(6, seed=2)
    ref = model.reference_model()
    out = run_stages(model.stages, x)
    loss = model.loss_fn(out, y)
    loss.backward()
    ref_loss = model.loss_fn(ref(x), y)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    ref_params = dict(ref.named_parameters())
    for i, stage in enumerate(model.stages):
        for pname, p in stage.named_parameters():
            rp = ref_params[f"stages.{i}.{pname}"]
            assert rp is not p  # a copy, so reference runs do not touch the stages
            assert torch.equal(rp.grad, p.grad), (i, pname)


def test_make_batch_is_deterministic_and_shaped():
    mlp = build_model("mlp", 2, **SMALL["mlp"])
    x1, y1 = mlp.make_batch(5, seed=7)
    x2, y2 = mlp.make_batch(5, seed=7)
    x3, _ = mlp.make_batch(5, seed=8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert x1.shape == y1.shape == (5, 16)
    gpt = build_model("gpt", 2, **SMALL["gpt"])
    tokens, targets = gpt.make_batch(3, seed=0)
    assert tokens.shape == targets.shape == (3, 8)
    assert tokens.dtype == torch.long
    assert torch.equal(tokens[:, 1:], targets[:, :-1])  # next-token targets
    assert gpt.tokens_per_sample == 8 and mlp.tokens_per_sample is None
    with pytest.raises(ModelError, match="batch"):
        mlp.make_batch(0)


def test_gpt_loss_starts_near_uniform_and_stages_hold_embedding_and_head():
    gpt = build_model("gpt", 3, **SMALL["gpt"])
    x, y = gpt.make_batch(4)
    loss = gpt.loss_fn(run_stages(gpt.stages, x), y)
    assert abs(loss.item() - math.log(50)) < 0.5
    first = {n for n, _ in gpt.stages[0].named_parameters()}
    last = {n for n, _ in gpt.stages[-1].named_parameters()}
    assert any("tok.weight" in n for n in first)
    assert any("out.weight" in n for n in last)


def test_tuple_model_passes_int_tensor_between_stages():
    model = build_model("tuple", 2, **SMALL["tuple"])
    x, _ = model.make_batch(8)
    mid = model.stages[0](x)
    assert isinstance(mid, tuple) and len(mid) == 3
    hid, skip, bucket = mid
    assert hid.requires_grad and skip.requires_grad
    assert bucket.dtype == torch.long and bucket.shape == (8,)
    # packed and unpacked calls are the same
    assert torch.equal(model.stages[1](mid), model.stages[1](*mid))
    # the bucket ids matter: other ids give another output
    other = model.stages[1](hid, skip, (bucket + 1) % 3)
    assert not torch.equal(other, model.stages[1](mid))


def test_uneven_split_and_errors():
    model = build_model("mlp", 2, d_model=8, d_hidden=8, n_blocks=5)
    assert [len(s.pieces) for s in model.stages] == [3, 2]
    # n_blocks grows with the stage count unless given
    assert len(build_model("mlp", 6, d_model=8, d_hidden=8).stages) == 6
    with pytest.raises(ModelError, match="cannot split 2 MLP blocks into 3 stages"):
        build_model("mlp", 3, d_model=8, d_hidden=8, n_blocks=2)
    with pytest.raises(VpipeError, match="unknown model 'cnn'"):
        build_model("cnn", 2)
    with pytest.raises(ModelError, match="has no size 'n_layers'"):
        build_model("mlp", 2, n_layers=3)
    with pytest.raises(ModelError, match="divisible"):
        build_model("gpt", 2, d_model=10, n_heads=3)
    with pytest.raises(ModelError, match="n_stages"):
        build_model("mlp", 0)
    assert set(model_names()) == {"mlp", "gpt", "tuple", "looped-mlp"}
