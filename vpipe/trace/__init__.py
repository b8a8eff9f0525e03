"""Profiler traces and results: recording (:mod:`.record`), Kineto JSON reading
(:mod:`.kineto_json`) and conversion to the event table (:mod:`.kineto`), the Parquet results
store (:mod:`.store`), synthetic traces (:mod:`.synth`) and interleaved profiling of several
schedules in one launch (:mod:`.profile_run`). Importing these modules does not import torch."""
