"""Whether the cluster planner still answers as it did: a few searches' JSON (every candidate
row, the recommendation and the counts) kept as a SHA-256 digest beside a readable summary,
written once, then compared. A change meant only to make the planner faster leaves every
digest as it was (floats to the last bit).

Run: ``python -m bench.cluster_same --write plans.json`` before the change, then
``python -m bench.cluster_same plans.json`` after it; ``--big`` adds Llama 3.1 405B on 1024
H100s (the whole search of ``bench.cluster_speed``: about a minute); ``--full FILE`` also
writes the plans themselves, to diff by hand. The small searches are kept in
``tests/data/cluster_plans.json`` and checked by ``tests/test_cluster_same.py``: a change
that moves the model's costs on purpose rewrites that file with ``--write``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Any

from vpipe.predict.cluster import ClusterSpec, default_budget, plan_cluster
from vpipe.sim.arch import load_arch
from vpipe.sim.machine import load_machine

# name -> (arch, machine, ClusterSpec fields)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3-70b, 64 H100s": ("llama3-70b", "h100", dict(gpus=64, batch=128)),
    "llama3-8b, 64 H100s, shard full, post-validated, microbatch 1 or 2": (
        "llama3-8b", "h100", dict(gpus=64, batch=128, shard="full", post_validated=True,
                                  microbatch_sizes=(1, 2))),
    "llama3-8b, 32 H200s, tp 2, shard none, replicas inner": (
        "llama3-8b", "h200", dict(gpus=32, batch=64, tp=2, shard="none", pp_inner=False)),
}  # fmt: skip
BIG = {"llama3.1-405b, 1024 H100s": ("llama3.1-405b", "h100", dict(gpus=1024, batch=2048))}
COUNTS = ("simulated", "bounded", "tried")


def plans(big: bool = False) -> dict[str, Any]:
    """Each case's plan as ``vpipe plan --arch ... --json`` prints it, read back."""
    out = {}
    for name, (arch, machine, kw) in {**CASES, **(BIG if big else {})}.items():
        m = load_machine(machine)
        plan = plan_cluster(ClusterSpec(load_arch(arch), m, budget=default_budget(m), **kw))
        out[name] = json.loads(json.dumps(plan))
    return out


def summary(plan: dict[str, Any]) -> dict[str, Any]:
    """What is kept of a plan: the digest of its JSON, the recommendation and the counts."""
    text = json.dumps(plan, sort_keys=True)
    rec = plan["recommended"]
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(),
            "candidates": len(plan["candidates"]), **{k: plan[k] for k in COUNTS},
            "recommended": {k: rec[k] for k in ("schedule", "tp", "cp", "pp", "dp", "recompute",
                                                "stages_per_rank", "microbatch_size",
                                                "microbatches", "tokens_per_s_per_gpu")}}  # fmt: skip


def differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One line per summary field that differs (the digest last: it differs whenever any
    other field does)."""
    keys = [k for k in now if k != "sha256"] + ["sha256"]
    return [f"{k}: {before.get(k)!r}, now {now[k]!r}" for k in keys if before.get(k) != now[k]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_same", description=__doc__)
    p.add_argument("file", help="the plans' summaries: written with --write, else compared")
    p.add_argument("--write", action="store_true", help="write the summaries to FILE")
    p.add_argument("--big", action="store_true", help="add 405B on 1024 GPUs (about a minute)")
    p.add_argument("--full", metavar="FILE", help="also write the plans themselves to FILE")
    args = p.parse_args(argv)
    now = plans(args.big)
    if args.full:
        with open(args.full, "w") as f:
            json.dump(now, f, indent=1)
    sums = {name: summary(plan) for name, plan in now.items()}
    if args.write:
        with open(args.file, "w") as f:
            json.dump(sums, f, indent=1)
            f.write("\n")
        print(f"wrote {len(sums)} plans' summaries to {args.file}")
        return 0
    with open(args.file) as f:
        before = json.load(f)
    bad = 0
    for name, s in sums.items():
        if name not in before:
            print(f"{name}: not in {args.file} (written without --big?)")
            bad += 1
            continue
        diff = differences(before[name], s)
        print(f"{name}: " + ("identical" if not diff else "differs: " + "; ".join(diff)))
        bad += bool(diff)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
