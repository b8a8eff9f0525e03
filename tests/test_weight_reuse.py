"""A weight used twice in a stage (``looped-mlp``): vpipe's split backward gets the reference's
gradients on every schedule family; torch's split-backward classes fail on it, and a sweep
records that failure as one line and goes on with the rest.

Launches: one 2-rank job for the gradient check (P=1 runs in this process), and one sweep
(two launches: the one torch's zbv ends, and the one without it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch

from vpipe.cli import main
from vpipe.errors import PipelineError
from vpipe.models import build_model
from vpipe.runtime.launch import spawn
from vpipe.schedules import make_schedule, schedule_names
from vpipe.sweep import torch_failures
from vpipe.sweep.harness import RankSpec, build

SIZES = {"d_model": 12, "d_hidden": 16}
BACKWARD_TWICE = "Trying to backward through the graph a second time"


def test_a_looped_block_runs_its_weights_twice():
    model = build_model("looped-mlp", 2, seed=0, **SIZES)
    block = model.stages[0].pieces[0]
    x = torch.randn(3, 12)
    once = x + block.fc2(block.act(block.fc1(block.norm(x))))
    twice = once + block.fc2(block.act(block.fc1(block.norm(once))))
    torch.testing.assert_close(block(x), twice)
    # fc1's weight feeds two matrix products: its gradient has two terms
    fc1_uses = [n for n in _graph(block(x).sum().grad_fn) if n == id(block.fc1.weight)]
    assert len(fc1_uses) == 2
    assert model.sizes["loops"] == 2 and len(model.stages) == 2


def _graph(node, seen=None) -> list[int]:
    """Ids of the parameters each edge of an autograd graph reaches (one entry per use)."""
    seen = set() if seen is None else seen
    out = []
    for nxt, _ in node.next_functions if node is not None else ():
        if nxt is None:
            continue
        if hasattr(nxt, "variable"):
            out.append(id(nxt.variable))
        elif nxt not in seen:
            seen.add(nxt)
            out += _graph(nxt, seen)
    return out


def check_every_schedule(rank: int, n_ranks: int) -> dict[str, list[dict]]:
    """Worker: one step of every schedule family on looped-mlp (vpipe's runtime), this rank's
    losses and gradients against the unpipelined reference (``vpipe run --check``'s check)."""
    out = {}
    for name in schedule_names():
        schedule = make_schedule(name, n_ranks, 4)
        h = build(RankSpec(schedule, model="looped-mlp", sizes=SIZES, batch=8), rank)
        out[name] = h.check(h.step())
    return out


def _assert_all_match(per_rank: list[dict[str, list[dict]]], n_ranks: int) -> None:
    assert len(per_rank) == n_ranks
    for name in schedule_names():
        findings = [f for r in per_rank for f in r[name]]
        n_params = sum(
            1 for s in build_model("looped-mlp", make_schedule(name, n_ranks, 4).n_stages,
                                   **SIZES).stages for _ in s.parameters()
        )  # fmt: skip
        grads = [f for f in findings if f["what"] == "gradient"]
        assert len(grads) == n_params, name  # every parameter has a gradient, compared
        assert sum(f["where"] == "losses" for f in findings) == 1, name
        bad = [f for f in findings if not f["ok"]]
        assert not bad, (name, bad)


def test_vpipe_gradients_match_the_reference_at_p1():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on a shared 2-core host: one thread, as each rank has
    try:
        _assert_all_match([check_every_schedule(0, 1)], 1)
    finally:
        torch.set_num_threads(threads)


def test_vpipe_gradients_match_the_reference_at_p2():
    _assert_all_match(spawn(check_every_schedule, 2, timeout_s=600), 2)


def test_a_sweep_records_torchs_failure_in_one_line_and_goes_on(tmp_path, capsys):
    """torch's zbv fails on the looped model; the sweep still runs vpipe's zbv and both 1f1b
    configs, stores a ``failed`` row with the cause and puts that cause in the report."""
    out = tmp_path / "out"
    args = ["bench", "--impl", "both", "--schedules", "1f1b,zbv", "-m", "4", "--batch", "8",
            "--model", "looped-mlp", "--sizes", "d_model=12,d_hidden=16", "--warmup", "1",
            "--steps", "1", "--rounds", "1", "--profile-steps", "1", "--max-minutes", "0",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    printed, err = capsys.readouterr()
    assert "Traceback" not in err and "Full Schedule" not in err  # torch's dump is held back
    assert "zbv-m4-torch: failed: " in err and "launching the sweep again without it" in err

    from vpipe.trace.store import Store

    runs = Store(out).runs()
    measured = runs[runs["source"] == "measured"].set_index(["schedule", "impl"])
    assert measured.loc[("zbv", "torch"), "status"] == "failed"
    cause = measured.loc[("zbv", "torch"), "error"]
    assert cause.startswith("torch's ScheduleZBVZeroBubble (rank ") and ", action " in cause
    assert BACKWARD_TWICE in cause and "\n" not in cause
    assert pd.isna(measured.loc[("zbv", "torch"), "step_time_s"])
    for ran in (("zbv", "vpipe"), ("1f1b", "vpipe"), ("1f1b", "torch")):
        assert measured.loc[ran, "status"] == "ok" and measured.loc[ran, "step_time_s"] > 0
    steps = pd.read_parquet(out / "steps.parquet")
    assert ("zbv", "torch") not in set(zip(steps["schedule"], steps["impl"], strict=True))

    line = f"zbv M=4 torch: failed: {cause}"
    assert line in printed.splitlines()
    md = (out / "report.md").read_text()
    section = md.split("## Configs that failed\n\n", 1)[1].split("\n## ", 1)[0]
    assert section.strip() == line  # one line, the cause, nothing else
    assert "Configs that failed" in (out / "report.html").read_text()
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 0  # failed row skipped


# ---------------------------------------------------------------------------------------------
# The failure record's parts, without processes


def test_the_cause_is_the_innermost_errors_first_sentence():
    try:
        try:
            raise RuntimeError("Trying to backward twice. Saved values are freed. Specify x.")
        except RuntimeError as inner:
            raise RuntimeError("\n   Failed to run stage backward input:\n ...") from inner
    except RuntimeError as e:
        cause = torch_failures.failure_cause(e, "zbv", 1, "2W0")
    assert cause == (
        "torch's ScheduleZBVZeroBubble (rank 1, action 2W0): RuntimeError: Trying to backward "
        "twice."
    )
    assert torch_failures.failure_cause(ValueError("no stop"), "nope", 0, None) == (
        "torch (rank 0): ValueError: no stop"
    )


def test_torchs_error_log_is_read_for_the_action_and_kept_off_stderr():
    logger = logging.getLogger("torch.distributed.pipelining.schedules")
    shown: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: shown.append(record.getMessage())
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not .level: it clears the logger's cached checks
    try:
        with torch_failures.torch_error_log() as actions:
            logger.error("_PipelineScheduleRuntime caught exception at step %s when running "
                         "action %s.  Full Schedule:", 13, "3W0")  # fmt: skip
            logger.error("Step 00: 0F0")
            logger.info("kept")
        logger.error("after")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert actions == ["3W0"]
    assert shown == ["kept", "after"]


def test_launches_repeat_without_each_failed_config():
    planned = ["a-m1-torch", "b-m1-torch", "c-m1-vpipe"]

    def launcher(failed: dict[str, str], launches: list) -> Callable[[str], list]:
        def launch(directory: str) -> list:
            left = [k for k in planned if k not in failed]
            launches.append(left)
            if left[0].endswith("-torch"):  # the first torch config left fails, rank 1 first
                for rank, when in ((0, 20), (1, 10)):
                    cause = f"{when} why r{rank}\n"
                    (Path(directory) / f"{left[0]}.rank{rank}").write_text(cause)
                raise PipelineError("rank 1 failed: it broke")
            return ["done"]

        return launch

    failed: dict[str, str] = {}
    launches: list = []
    left = lambda: len([k for k in planned if k not in failed])  # noqa: E731
    assert torch_failures.launch_until_done(launcher(failed, launches), failed, left) == ["done"]
    assert launches == [planned, planned[1:], planned[2:]]
    assert failed == {"a-m1-torch": "why r1", "b-m1-torch": "why r1"}  # the first to fail

    def other_error(directory: str) -> list:
        raise PipelineError("rank 0 failed: something else")

    with pytest.raises(PipelineError, match="something else"):
        torch_failures.launch_until_done(other_error, {}, lambda: 1)
    with pytest.raises(torch_failures.TorchConfigFailed, match="every config of the sweep failed"):
        torch_failures.launch_until_done(launcher({}, []), {}, lambda: 0)


def test_warm_up_records_a_torch_failure_and_lets_vpipes_errors_through(tmp_path):
    class Broken:
        def timed_step(self) -> None:
            raise RuntimeError("Trying to backward through the graph a second time (or so). More.")

    with pytest.raises(torch_failures.TorchConfigFailed) as e:
        torch_failures.warm_up("zbv-m4-torch", "torch", "zbv", Broken, 0, 1, str(tmp_path))
    cause = "torch's ScheduleZBVZeroBubble (rank 1): RuntimeError: Trying to backward through " \
        "the graph a second time (or so)."  # fmt: skip
    assert str(e.value) == f"torch config zbv-m4-torch failed: {cause}"  # one step despite 0
    assert torch_failures.read_failures(tmp_path) == {"zbv-m4-torch": cause}
    with pytest.raises(torch_failures.TorchConfigFailed, match="let vpipe bench launch the ranks"):
        torch_failures.warm_up("zbv-m4-torch", "torch", "zbv", Broken, 2, 0, None)  # torchrun
    with pytest.raises(RuntimeError, match="second time"):  # vpipe's own failures stay loud
        torch_failures.warm_up("zbv-m4-vpipe", "vpipe", "zbv", Broken, 1, 0, str(tmp_path))
    assert torch_failures.warm_up("zbv-m4-vpipe", "vpipe", "zbv", Broken, 0, 0, None)


def test_failure_lines_read_any_runs_table():
    from vpipe.report.document import failure_lines
    from vpipe.trace.store import runs_frame

    runs = runs_frame([
        {"run_id": "a", "schedule": "zbv", "microbatches": 4, "impl": "torch",
         "status": "failed", "error": "torch's X (rank 0): RuntimeError: no."},
        {"run_id": "b", "schedule": "zbv", "microbatches": 4, "impl": "vpipe"},  # no status
    ])  # fmt: skip
    assert failure_lines(runs) == ["zbv M=4 torch: failed: torch's X (rank 0): RuntimeError: no."]
    assert failure_lines(runs.drop(columns="status")) == []
