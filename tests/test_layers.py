"""The layout shows the data flow: no module imports from a layer above its own (counting lazy
imports inside functions too), and no module grows past ~500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import vpipe

ROOT = Path(vpipe.__file__).parent

# Lowest layer first: schedule -> lowered program -> runtime or simulator -> events (metrics
# over them) -> Parquet -> calibration and the rank harness -> plots and reports -> sweeps ->
# commands. A module may import from its own
# layer and the ones below. The most specific prefix decides.
LAYERS: list[tuple[str, ...]] = [
    ("vpipe.errors", "vpipe.ir", "vpipe.events", "vpipe.outputs"),
    ("vpipe.schedules", "vpipe.flat"),
    (
        "vpipe.passes",
        "vpipe.engine",
        "vpipe.lowering",
        "vpipe.validation",
        "vpipe.cost_model",
        "vpipe.bundling",
    ),
    ("vpipe.schedules.load",),
    (
        "vpipe.sim",
        "vpipe.runtime",
        "vpipe.baselines",
        "vpipe.models",
        "vpipe.custom_model",
        "vpipe.sim_compare",
        "vpipe.timing",
    ),
    # pure functions of event tables and step times; the store's columns
    ("vpipe.analysis", "vpipe.metrics", "vpipe.stats", "vpipe.host_state", "vpipe.crossrun"),
    ("vpipe.trace",),
    ("vpipe.calibrate", "vpipe.step_replay", "vpipe.harness", "vpipe.reference"),
    (
        "vpipe.plan",
        "vpipe.plots",
        "vpipe.report",
        "vpipe.comparison",
        "vpipe.crossrun_report",
        "vpipe.winner",
    ),
    ("vpipe.bench", "vpipe.bench_results", "vpipe.bench_report", "vpipe.sweep_blocks"),
    ("vpipe.commands", "vpipe.cli", "vpipe.__main__", "vpipe"),
]
MAX_LINES = 520


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            inside = module == p or (p != "vpipe" and module.startswith(p + "."))
            if inside and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def module_name(path: Path) -> str:
    parts = ["vpipe", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def vpipe_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a vpipe module in the file, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("vpipe")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("vpipe"):
                # `from vpipe.x import y` may import the submodule vpipe.x.y
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    known = (ROOT / Path(*sub.split(".")[1:])).with_suffix(".py").exists()
                    found.append((node.lineno, sub if known else node.module))
    return found


MODULES = sorted(ROOT.rglob("*.py"))


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for path in MODULES:
        me = module_name(path)
        for line, target in vpipe_imports(path):
            if target != "vpipe" and layer_of(target) > layer_of(me):
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} {me} imports {target}")
    assert not upward, "\n".join(upward)


def test_layers_detect_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from vpipe.bench import SweepSpec\n")
    ((line, target),) = vpipe_imports(bad)
    assert (line, target) == (2, "vpipe.bench") and layer_of(target) > layer_of("vpipe.sim")


def test_no_module_over_the_size_limit():
    long = {
        str(p.relative_to(ROOT.parent)): n
        for p in MODULES
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
