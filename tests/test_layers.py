"""The layout shows the data flow: no module imports from a layer above its own (counting lazy
imports inside functions too), and no module grows past ~500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import vpipe

ROOT = Path(vpipe.__file__).parent

# Lowest layer first, one folder per layer: shared leaves -> the schedule IR and its passes ->
# schedule families -> the simulator, models, runtime and torch baseline (peers) -> metrics of
# event tables -> traces and the Parquet store -> predictions from measured runs -> plots and
# reports -> sweeps (which drive everything below) -> commands. A module may import from its own
# layer and the ones below. The most specific prefix decides.
LAYERS: list[tuple[str, ...]] = [
    ("vpipe.errors", "vpipe.events", "vpipe.outputs", "vpipe.stats", "vpipe.timing", "vpipe.compat"),
    ("vpipe.ir",),
    ("vpipe.schedules",),
    ("vpipe.sim", "vpipe.models", "vpipe.runtime", "vpipe.baselines"),
    ("vpipe.metrics",),
    ("vpipe.trace",),
    ("vpipe.predict",),
    ("vpipe.report",),
    ("vpipe.sweep",),
    ("vpipe.commands", "vpipe.cli", "vpipe.__main__", "vpipe"),
]
MAX_LINES = 500
MAX_TOP_LEVEL_MODULES = 10


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
    bad.write_text("def f():\n    from vpipe.sweep.driver import SweepSpec\n")
    ((line, target),) = vpipe_imports(bad)
    assert (line, target) == (2, "vpipe.sweep.driver") and layer_of(target) > layer_of("vpipe.sim")


def test_no_module_over_the_size_limit():
    long = {
        str(p.relative_to(ROOT.parent)): n
        for p in MODULES
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def import_graph() -> dict[str, set[str]]:
    """Module -> the vpipe modules it imports (lazy imports included)."""
    known = {module_name(p) for p in MODULES}
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        me = module_name(path)
        graph[me] = {t for _, t in vpipe_imports(path) if t in known and t not in ("vpipe", me)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_circle_detection_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_few_modules_at_the_top():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_every_layer_folder_is_listed():
    """A new folder must be placed in LAYERS (layer_of asserts for unknown modules)."""
    for path in MODULES:
        layer_of(module_name(path))
