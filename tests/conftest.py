"""Shared pytest setup: the skip policy plugin (see ``skip_policy``), and, under parallel
workers (pytest-xdist, ``make test``), each worker's share of the cores."""

from __future__ import annotations

import os

pytest_plugins = ["skip_policy"]


def pytest_configure(config) -> None:
    """On a worker, cap the cores vpipe divides among its ranks (``VPIPE_CORES``, inherited by
    every process the worker starts) and this process's torch threads to the worker's share,
    so that two workers' ranks do not each take every core for intra-op threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "VPIPE_CORES" in os.environ:
        return
    from vpipe.runtime.launch import usable_cores

    share = max(1, usable_cores() // workers)
    os.environ["VPIPE_CORES"] = str(share)
    import torch

    torch.set_num_threads(share)
