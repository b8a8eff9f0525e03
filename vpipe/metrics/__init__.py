"""Figures of a run, from its event tables and timed steps (measured or simulated alike): the
per-run figures (:mod:`.per_run`: busy, idle, bubble, peak memory per step and rank) and the
metric catalogue (:mod:`.catalogue`: every run-level metric once, from which the runs table's
columns, the reports, ``vpipe analyze`` and the asv suite are generated). Pure functions of
tables: nothing here reads or writes files.

A new metric is one :class:`Metric` entry in :mod:`.catalogue` (``register`` it from outside).
"""

from vpipe import compat

__getattr__ = compat.forward_attributes(__name__, ("vpipe.metrics.catalogue",))
