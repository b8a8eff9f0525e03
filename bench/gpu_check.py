"""``make gpu-check``: does vpipe run, time, meter and trace correctly on one GPU?

About two minutes on one GPU (check_v_one_rank, check_two_ranks_one_gpu, then the device-clock
checks of :mod:`bench.gpu_device_checks`: CUDA events against the profiler's device spans,
busy + bubble = step on the device clock, a host-bound action reading as device idle, and NCCL
on two GPUs, skipped with one line where there is one):

- ``v-one-rank``: the V placement on one rank (zbv, P=1: stages 0 and 1 both on rank 0, handed
  over locally), GPT model, a few steps in this process through :mod:`vpipe.sweep.harness`; losses
  and every gradient against the unpipelined CPU reference; step time from CUDA events and the
  CUDA allocator's peak.
- ``two-ranks-one-gpu``: ``vpipe run zbv -p 2 --device cuda --backend gloo --check --profile DIR``
  (two processes sharing cuda:0, gloo through host copies); its Kineto traces converted, each
  rank's compute rows per profiled step against its program's compute actions (a CUDA trace
  repeats every span on the GPU stream: no action may count twice), the bubble ratio, and no
  profiler ``USDT`` lines in the output.

One ``PASS``/``FAIL`` line per check at the end; the exit status is 1 if any failed. Without a
CUDA device it says so in one line and exits with status 2 at once. The check functions take a
``device`` so that the tests run them on the CPU.

Run: ``python -m bench.gpu_check`` (or ``make gpu-check``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SCHEDULE = "zbv"
MICROBATCHES = 4
BATCH = 32
GPT_SIZES = {"vocab": 1024, "d_model": 256, "n_heads": 4, "n_layers": 4, "seq_len": 128}
TOL = 1e-4  # relative to the reference tensor's largest magnitude; GPU vs CPU in float32


@dataclass
class Outcome:
    """One check's verdict and what it measured, in words."""

    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def check_v_one_rank(
    device: str = "cuda",
    sizes: Mapping[str, int] = GPT_SIZES,
    batch: int = BATCH,
    steps: int = 5,
    tol: float = TOL,
) -> Outcome:
    """zbv at P=1 (both stages on rank 0) in this process: reference check, step time, peak."""
    import torch.distributed as dist

    from vpipe.ir.lowering import lower
    from vpipe.schedules import make_schedule
    from vpipe.sweep.harness import RankSpec, build

    schedule = lower(make_schedule(SCHEDULE, 1, MICROBATCHES))
    spec = RankSpec(schedule, model="gpt", sizes=dict(sizes), batch=batch, device=device)
    spec.check()
    own_group = not dist.is_initialized()  # timed steps start at a barrier: a group of one
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        h = build(spec, 0)
        times = [h.timed_step() for _ in range(steps)]
        findings = h.check(h.losses, tol)
        memory = h.memory_step()
    finally:
        if own_group:
            dist.destroy_process_group()
    timed = times[1:] or times  # the first step infers shapes
    median_ms = statistics.median(timed) * 1e3
    worst = max(f["err"] for f in findings)
    bad = [f"{f['where']} ({f['what']}, {f['err']:.1e})" for f in findings if not f["ok"]]
    peak = memory.get("cuda_peak_bytes")
    clock = "CUDA events" if h.cuda else "host clock"
    detail = (
        f"{SCHEDULE} P=1 stages {schedule.stages_of(0)} on one rank, gpt batch {batch} "
        f"M={MICROBATCHES}: median step {median_ms:.2f} ms ({clock}, {len(timed)} steps); "
        f"{len(findings)} reference comparisons, max relative error {worst:.1e} (tol {tol:g})"
        + (f"; CUDA allocator peak {peak / 2**20:.1f} MiB" if peak is not None else "")
    )
    ok = not bad and all(t > 0 for t in times) and (not h.cuda or (peak or 0) > 0)
    if bad:
        detail += "; mismatches: " + ", ".join(bad[:3])
    return Outcome("v-one-rank", ok, detail)


def check_two_ranks_one_gpu(
    out_dir: str | Path,
    device: str = "cuda",
    sizes: Mapping[str, int] = GPT_SIZES,
    batch: int = BATCH,
    tol: float = TOL,
    timeout_s: float = 300.0,
) -> Outcome:
    """``vpipe run`` with two gloo ranks on one device, profiled; the traces converted and
    compared with the programs."""
    from vpipe.events import COMPUTE_KINDS
    from vpipe.metrics.catalogue import summarize
    from vpipe.schedules import make_schedule
    from vpipe.trace.kineto import convert

    ranks, name = 2, "two-ranks-one-gpu"
    out = Path(out_dir)
    argv = [sys.executable, "-m", "vpipe", "run", SCHEDULE, "-p", str(ranks)]
    argv += ["-m", str(MICROBATCHES), "--batch", str(batch), "--steps", "3", "--model", "gpt"]
    argv += ["--sizes", ",".join(f"{k}={v}" for k, v in sizes.items())]
    argv += ["--device", device, "--backend", "gloo", "--check", "--tol", f"{tol:g}"]
    argv += ["--profile", str(out)]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Outcome(name, False, f"vpipe run did not finish in {timeout_s:.0f} s")
    printed = r.stdout + r.stderr
    if r.returncode != 0:
        tail = " | ".join(printed.strip().splitlines()[-3:])
        return Outcome(name, False, f"vpipe run exited {r.returncode}: {tail}")
    for line in r.stdout.splitlines():
        if line.startswith(("check:", "summary:")):
            print(f"  {line}", flush=True)
    files = sorted(p.name for p in out.iterdir())
    events = convert([out]).events
    program = make_schedule(SCHEDULE, ranks, MICROBATCHES)
    want = {
        rank: sum(len(a.compute_parts()) for a in program.actions[rank] if a.is_compute)
        for rank in range(ranks)
    }
    compute = events[events["kind"].astype(str).isin(COMPUTE_KINDS)]
    got = compute.groupby(["rank", "step"], observed=True).size()
    rows = {rank: sorted(set(got[rank].tolist())) if rank in got else [] for rank in want}
    bubble = summarize(events)["bubble_ratio"]
    usdt = sum("USDT" in line for line in printed.splitlines())
    ok = (
        files == [f"rank{k}.pt.trace.json" for k in range(ranks)]
        and all(rows[k] == [want[k]] for k in want)
        and usdt == 0
    )
    counts = ", ".join(
        f"rank {k} {'/'.join(map(str, rows[k])) or 'none'} (program {want[k]})" for k in want
    )
    detail = (
        f"{SCHEDULE} P={ranks} on one {device} device over gloo: compute rows per profiled "
        f"step {counts}; bubble ratio {bubble:.3f}; traces {', '.join(files)}; "
        f"{usdt} USDT lines printed"
    )
    return Outcome(name, ok, detail)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every check on cuda:0; 0 if all pass, 1 if any fails, 2 without a CUDA device."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}): nothing checked; run it on a GPU machine"
        )
        return 2
    print(f"gpu-check on {torch.cuda.get_device_name(0)} (torch {torch.__version__})", flush=True)
    from bench.gpu_device_checks import device_checks, nccl_check

    outcomes = [check_v_one_rank()]
    outcomes += [Outcome(*o) for o in device_checks(GPT_SIZES, BATCH)]
    with tempfile.TemporaryDirectory(prefix="vpipe-gpu-check-") as tmp:
        outcomes.append(check_two_ranks_one_gpu(Path(tmp) / "gloo"))
        name, ok, detail = nccl_check(Path(tmp) / "nccl", GPT_SIZES, BATCH)
    skipped = [f"SKIP {name}: {detail}"] if ok is None else []
    outcomes += [] if ok is None else [Outcome(name, ok, detail)]
    for line in [o.line() for o in outcomes] + skipped:
        print(line, flush=True)
    failed = sum(not o.ok for o in outcomes)
    print(f"gpu-check: {len(outcomes) - failed} of {len(outcomes)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
