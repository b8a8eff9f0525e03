"""Predictions from measured runs: a cost model calibrated from a run's events
(:mod:`.calibrate`, with leave-one-out fidelity), each measured step replayed with its own
action times (:mod:`.step_replay`), and ``vpipe plan``'s recommendation for a memory budget
(:mod:`.plan`). Sits above the store and the metrics it reads, and drives the simulator.
"""
