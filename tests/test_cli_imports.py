"""The schedule commands answer without the heavy stacks: each runs in one fresh interpreter,
and after each we look at which of torch, pandas, pyarrow, matplotlib and seaborn it loaded."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

HEAVY = ("torch", "pandas", "pyarrow", "matplotlib", "seaborn")

PROBE = """
import contextlib, io, json, sys
from vpipe.cli import main
heavy = {heavy!r}
loaded = {{}}
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    assert rc in (0, None), (argv, rc)
    loaded[" ".join(argv)] = sorted({{m.split(".")[0] for m in sys.modules}} & set(heavy))
print(json.dumps(loaded))
"""


def test_schedule_commands_import_no_heavy_stack(tmp_path):
    csv = str(tmp_path / "zbv.csv")
    commands = [
        ["--version"],
        ["schedules"],
        ["show", "zbv", "-p", "4", "-m", "8"],
        ["show", "zbv", "-p", "4", "-m", "8", "--csv", csv],
        ["validate", csv],
        ["simulate", "zbv", "-p", "4", "-m", "8", "--cost", "f=1,b=1,w=1,comm=0.5"],
        ["compare", "-p", "4", "-m", "8"],
        [
            "plan",
            "-p",
            "4",
            "--batch",
            "64",
            "--memory",
            "8units",
            "--cost",
            "f=10,b=10,w=8,comm=1",
        ],
        [
            "plan",
            "--arch",
            "llama3-8b",
            "--seq-len",
            "1024",
            "--machine",
            "h100",
            "--gpus",
            "8",
            "--batch",
            "32",
            "--schedules",
            "1f1b,zbv",
        ],
    ]
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), json.dumps(commands)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    loaded = json.loads(out.stdout)
    assert list(loaded) == [" ".join(c) for c in commands]
    assert {cmd: mods for cmd, mods in loaded.items() if mods} == {}


def test_the_probe_sees_a_heavy_import():
    """The check above can fail: importing the store loads pandas and pyarrow."""
    code = "import sys; import vpipe.trace.store; print(sorted({m.split('.')[0] for m in sys.modules} & {'pandas', 'pyarrow'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['pandas', 'pyarrow']"


@pytest.mark.parametrize(
    "old, name, new",
    [
        ("vpipe.passes", "lower", "vpipe.ir.lowering"),
        ("vpipe.custom_model", "ModelParts", "vpipe.models.custom"),
        ("vpipe.analysis", "summarize", "vpipe.metrics.catalogue"),
        ("vpipe.analysis", "rank_metrics", "vpipe.metrics.per_run"),
        ("vpipe.harness", "RankSpec", "vpipe.sweep.harness"),
    ],
)
def test_old_module_paths_forward_to_the_new_place(old, name, new):
    import importlib

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    assert any(
        new.split(".")[1] in str(w.message) and issubclass(w.category, DeprecationWarning)
        for w in caught
    )


def test_an_old_path_without_the_name_says_where_it_went():
    import vpipe.passes  # noqa: F401

    with pytest.raises(AttributeError, match="vpipe.ir.lowering"):
        vpipe.passes.no_such_thing  # noqa: B018


def test_packages_that_were_modules_keep_their_names():
    import vpipe.ir
    import vpipe.metrics
    import vpipe.report
    import vpipe.sim
    from vpipe.ir.schedule import v_placement
    from vpipe.metrics.catalogue import registry
    from vpipe.report.document import summary_table
    from vpipe.sim.simulator import simulate

    assert vpipe.ir.v_placement is v_placement and vpipe.sim.simulate is simulate
    assert vpipe.metrics.registry is registry and vpipe.report.summary_table is summary_table


def test_a_sweep_rank_needs_no_plotting_stack():
    """What a sweep's rank imports (its driver, rounds and the verdict rules that decide its
    extra rounds) loads neither matplotlib nor seaborn: 0.8 s a launch on rank 0 otherwise."""
    code = (
        "import sys; import vpipe.sweep.driver, vpipe.sweep.rounds, vpipe.report.winner, "
        "vpipe.sweep.dp_bench; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'seaborn', 'scipy'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
