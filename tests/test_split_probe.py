"""The split probe times (I + W) / B on a rank's stages and leaves nothing behind."""

import torch

from vpipe.models import build_model
from vpipe.runtime.stage import Stage
from vpipe.sweep.split_probe import probe_forwards, probe_split

SIZES = {"d_model": 32, "d_hidden": 64, "n_blocks": 4}
ROWS = 8


def stages(recompute: str = "none") -> dict[int, Stage]:
    """Stages 0, 1 and 2 (the last, with the loss) of a 3-stage MLP, shaped as after a step."""
    model = build_model("mlp", 3, **SIZES)
    meta = (((ROWS, SIZES["d_model"]), torch.float32),)
    out = {}
    for s, module in enumerate(model.stages):
        st = Stage(s, 3, module, model.loss_fn if s == 2 else None, recompute)
        st.set_meta(meta, () if s == 2 else meta)
        out[s] = st
    return out


def test_probe_times_stages_with_an_input_gradient_and_leaves_nothing():
    mine = stages()
    targets = torch.randn(2 * ROWS, SIZES["d_model"])  # the rank's step: 2 microbatches
    rng = torch.get_rng_state()
    ratios = probe_split(mine, targets, 2, torch.device("cpu"), seconds=0.0, min_repeats=3)
    assert len(ratios) == 3 * 2  # repeats x stages 1 and 2 (stage 0 has no input gradient)
    assert all(r > 0 for r in ratios)
    assert torch.equal(torch.get_rng_state(), rng)
    for st in mine.values():
        assert st.live_entries() == 0
        assert all(p.grad is None for p in st.module.parameters())


def test_probe_skips_first_stages_recomputing_ones_and_unshaped_ones():
    cpu = torch.device("cpu")
    assert probe_split({0: stages()[0]}, None, 1, cpu, seconds=0.0) == []
    full = stages("full")
    assert probe_split({1: full[1]}, None, 1, cpu, seconds=0.0) == []
    fresh = Stage(1, 3, build_model("mlp", 3, **SIZES).stages[1], None)  # before any step
    assert probe_split({1: fresh}, None, 1, cpu, seconds=0.0) == []


def test_forward_probe_times_every_stage_that_keeps_its_activations():
    mine = stages()
    targets = torch.randn(2 * ROWS, SIZES["d_model"])
    rng = torch.get_rng_state()
    got = probe_forwards(mine, targets, 2, torch.device("cpu"), repeats=3)
    assert sorted(got) == [0, 1, 2] and all(t > 0 for t in got.values())  # the first stage too
    assert torch.equal(torch.get_rng_state(), rng)
    for st in mine.values():
        assert st.live_entries() == 0
        assert all(p.grad is None for p in st.module.parameters())
    cpu = torch.device("cpu")
    assert probe_forwards(stages("full"), None, 1, cpu) == {}  # recomputing: not probed
    fresh = Stage(1, 3, build_model("mlp", 3, **SIZES).stages[1], None, "none")
    assert probe_forwards({1: fresh}, None, 1, cpu) == {}  # no shapes yet
