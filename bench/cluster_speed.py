"""How long a cluster plan takes: Llama 3.1 405B on 1024 H100s, the whole search (every
split, recomputation, schedule, stages per rank and microbatch size), and one layout fixed
in full (torchtitan's FSDP 8 x TP 8 x PP 8 with full recomputation on 512 GPUs). Times are
wall seconds on this host, printed with its load: a shared host makes them longer.

Run: ``python -m bench.cluster_speed``.
"""

from __future__ import annotations

import os
import time

from vpipe.predict.cluster import ClusterSpec, default_budget, plan_cluster
from vpipe.sim.arch import load_arch
from vpipe.sim.machine import load_machine

CASES = {
    "405B, 1024 GPUs, full search": dict(gpus=1024, batch=2048),
    "405B, 512 GPUs, tp 8 x pp 8 x dp 8, shard full, recompute full, interleaved-1f1b, mb 1":
        dict(gpus=512, batch=2048, tp=8, pp=8, dp=8, shard="full", recompute="full",
             schedules=("interleaved-1f1b",), microbatch_sizes=(1,)),
}  # fmt: skip


def main() -> int:
    arch, machine = load_arch("llama3.1-405b"), load_machine("h100")
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    for name, kw in CASES.items():
        start = time.perf_counter()
        result = plan_cluster(ClusterSpec(arch, machine, budget=default_budget(machine), **kw))
        took = time.perf_counter() - start
        rec = result["recommended"]
        print(f"{name}: {took:.1f} s ({result['tried']} candidates, {result['bounded']} left "
              f"out by their bound); recommended {rec['schedule']} tp={rec['tp']} cp={rec['cp']} "
              f"pp={rec['pp']} dp={rec['dp']} recompute {rec['recompute']}, "
              f"{rec['tokens_per_s_per_gpu']:.1f} tokens/s per GPU")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
