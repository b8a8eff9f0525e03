"""Benchmark sweeps, end to end: the rank harness, the one place a rank's pipeline (vpipe's or
torch's) is built and stepped (:mod:`.harness`, also used by ``vpipe run`` and asv); the sweep
driver, many configs in one launch of P ranks (:mod:`.driver`); the sweep's tables
(:mod:`.results`); and its outputs: store, plots, report (:mod:`.write`). This layer drives all
the others, so it sits at the top, below the commands only.
"""
