"""Old import paths keep working: before the package had one folder per layer, its modules sat
directly under ``vpipe/`` (``vpipe.passes``, ``vpipe.harness``, ...). Importing one of those
names gives a module that forwards every attribute to the module's new home and warns once
(DeprecationWarning) naming it. Installed by :mod:`vpipe` on import."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

# old module -> its new home(s), searched in order
MOVED: dict[str, tuple[str, ...]] = {
    "vpipe.flat": ("vpipe.ir.flat",),
    "vpipe.engine": ("vpipe.ir.engine",),
    "vpipe.validation": ("vpipe.ir.validation",),
    "vpipe.passes": ("vpipe.ir.lowering",),
    "vpipe.bundling": ("vpipe.ir.bundling",),
    "vpipe.cost_model": ("vpipe.sim.cost_model",),
    "vpipe.sim_compare": ("vpipe.sim.compare",),
    "vpipe.custom_model": ("vpipe.models.custom",),
    "vpipe.analysis": ("vpipe.metrics.per_run", "vpipe.metrics.catalogue"),
    "vpipe.calibrate": ("vpipe.predict.calibrate",),
    "vpipe.step_replay": ("vpipe.predict.step_replay",),
    "vpipe.plan": ("vpipe.predict.plan",),
    "vpipe.harness": ("vpipe.sweep.harness",),
    "vpipe.bench": ("vpipe.sweep.driver",),
    "vpipe.bench_results": ("vpipe.sweep.results",),
    "vpipe.bench_report": ("vpipe.sweep.write",),
    "vpipe.plots": ("vpipe.report.plots",),
    "vpipe.comparison": ("vpipe.report.comparison",),
}


def find_attribute(owner: str, targets: Sequence[str], attr: str) -> Any:
    """``attr`` of the first of ``targets`` (module names, imported now) that has it."""
    if not attr.startswith("__"):
        for target in targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                return getattr(module, attr)
    raise AttributeError(f"module {owner!r} has no attribute {attr!r} (looked in {', '.join(targets)})")


def forward_attributes(owner: str, targets: Sequence[str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for package ``owner`` that finds names in ``targets``,
    imported on first use: the package keeps the names its old module had without importing
    pandas or matplotlib until one is used."""
    return lambda attr: find_attribute(owner, targets, attr)


class _Forwarding(types.ModuleType):
    """A stand-in for a moved module: attribute reads go to the new module(s)."""

    def __init__(self, name: str, targets: Sequence[str]) -> None:
        super().__init__(name, f"Moved to {', '.join(targets)}.")
        self._targets = tuple(targets)

    def __getattr__(self, attr: str) -> Any:
        return find_attribute(self.__name__, self._targets, attr)

    def __dir__(self) -> list[str]:
        return sorted({a for t in self._targets for a in dir(importlib.import_module(t))})


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        targets = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {' and '.join(targets)}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return _Forwarding(spec.name, targets)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the stand-in forwards on demand."""


def install() -> None:
    """Put the finder for moved modules on ``sys.meta_path`` once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
