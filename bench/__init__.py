"""Evaluation scripts (`python -m bench.NAME`): figures that a test cannot assert on a shared
host (false-alarm rates, scheduler quality, the GPU check). The asv suite is in benchmarks/."""
