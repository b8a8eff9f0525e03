"""Profiler traces and results: recording (:mod:`.record`, with its stderr filter
:mod:`.quiet`), Kineto JSON reading (:mod:`.kineto_json`) and conversion to the event table
(:mod:`.kineto`), the Parquet results store (:mod:`.store`) and synthetic traces (:mod:`.synth`).
Importing these modules does not import torch."""
