"""Shared pytest setup: the skip policy plugin (see ``skip_policy``), and, under parallel
workers (pytest-xdist, ``make test``), each worker's share of the cores."""

from __future__ import annotations

import os

pytest_plugins = ["skip_policy"]

# The files whose tests take longest (``pytest --durations``), handed out first under parallel
# workers (``make test`` keeps this order: --no-loadscope-reorder), so that none of them starts
# last and runs alone while the other worker has finished.
SLOW_FIRST = (
    "test_asv.py",
    "test_ab.py",
    "test_ab_versions.py",
    "test_interrupt_bench.py",
    "test_plan.py",
    "test_custom_model.py",
    "test_bench_torchrun.py",
    "test_weight_reuse.py",
    "test_torch_own_traces.py",
)


def _workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def pytest_collection_modifyitems(session, config, items) -> None:
    """On parallel workers, the files of :data:`SLOW_FIRST` first, in that order; the others
    after them, as collected (every worker collects the same order)."""
    if _workers() > 1:
        first = {name: i for i, name in enumerate(SLOW_FIRST)}
        items.sort(key=lambda item: first.get(item.path.name, len(first)))


def pytest_configure(config) -> None:
    """On a worker, cap the cores vpipe divides among its ranks (``VPIPE_CORES``, inherited by
    every process the worker starts) and this process's torch threads to the worker's share,
    so that two workers' ranks do not each take every core for intra-op threads."""
    workers = _workers()
    if workers <= 1 or "VPIPE_CORES" in os.environ:
        return
    from vpipe.runtime.launch import usable_cores

    share = max(1, usable_cores() // workers)
    os.environ["VPIPE_CORES"] = str(share)
    import torch

    torch.set_num_threads(share)
