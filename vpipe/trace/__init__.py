"""Profiler traces: recording (:mod:`.record`), Kineto JSON conversion (:mod:`.kineto`) and the
Parquet results store (:mod:`.store`). Importing this package does not import torch."""
