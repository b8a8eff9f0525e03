"""``make gpu-check``: does vpipe run, time, meter and trace correctly on a GPU, and what does
one GPU's quick sweep say? One script for a few minutes of a GPU (about four on one H200).

Checks (one ``PASS``/``FAIL``/``SKIP`` line each; every check has a test that feeds it an
input built to break it and sees it fail):

- ``device-reference`` (a ``MEASURED`` line: a measurement, never a pass, not counted among
  the checks): a fixed bf16 matrix product timed by CUDA events, and the GPU's clocks,
  temperature, power and slowdown reasons (NVML, each figure read on its own).
- ``v-one-rank``: the V placement on one rank (zbv, P=1: stages 0 and 1 both on rank 0, handed
  over locally), small GPT model in the default precision (bf16 on CUDA), a few steps in this
  process through :mod:`vpipe.sweep.harness`; losses and every gradient against the
  unpipelined float32 CPU reference with the precision's tolerance; step time from CUDA events
  and the CUDA allocator's peak.
- the device-clock checks of :mod:`bench.gpu_device_checks` (``events-vs-profiler``,
  ``device-timeline``, ``host-bound``; ``nccl-two-gpus`` where there are two GPUs).
- ``two-ranks-one-gpu``: ``vpipe run zbv -p 2 --device cuda --backend gloo --check --profile``
  (two processes sharing the GPU, gloo through host copies): each rank's compute rows per
  profiled step against its program, every one on the device clock, no profiler ``USDT`` lines.
- the session figures of :mod:`bench.gpu_sweeps`: a quick compute-bound sweep on the GPU with
  each prediction of a config from another config's calibration (goal: within 10%) and the
  profiler's overhead, an A/A of two launches compared by ``vpipe report`` (passes only on
  "within noise"), and two ranks over gloo on the one GPU (the regime the report states).

Everything lands in ``--out`` (default results/gpu-check): ``gpu-check.txt`` (every line
printed), ``figures.json`` (every figure), ``traces.tar.gz`` (the checks' Kineto traces) and
``sweeps.tar.gz`` (the sweeps' stores and reports): at most eight files, so that whoever has a
GPU for a few minutes brings back every figure at once. The exit status is 1 if any check
failed; without a CUDA device it says so in one line and exits 2 at once. The check functions
take a ``device`` so that the tests run them on the CPU.

Run: ``python -m bench.gpu_check [--out DIR]`` (or ``make gpu-check``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCHEDULE = "zbv"
MICROBATCHES = 4
BATCH = 32
GPT_SIZES = {"vocab": 1024, "d_model": 256, "n_heads": 4, "n_layers": 4, "seq_len": 128}


@dataclass
class Outcome:
    """One check's verdict (None: skipped) and what it measured, in words and figures."""

    name: str
    ok: bool | None
    detail: str
    figures: dict | None = None
    measurement: bool = False  # figures only (ok None): reported, never counted as a pass

    def line(self) -> str:
        word = "MEASURED" if self.measurement else "SKIP" if self.ok is None else (
            "PASS" if self.ok else "FAIL")
        return f"{word} {self.name}: {self.detail}"


def check_v_one_rank(
    device: str = "cuda",
    sizes: Mapping[str, int] = GPT_SIZES,
    batch: int = BATCH,
    steps: int = 5,
) -> Outcome:
    """zbv at P=1 (both stages on rank 0) in this process: reference check, step time, peak."""
    import torch.distributed as dist

    from vpipe.ir.lowering import lower
    from vpipe.schedules import make_schedule
    from vpipe.sweep.harness import CHECK_TOL, RankSpec, build

    schedule = lower(make_schedule(SCHEDULE, 1, MICROBATCHES))
    spec = RankSpec(schedule, model="gpt", sizes=dict(sizes), batch=batch, device=device)
    spec.check()
    tol = CHECK_TOL[spec.precision]
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
        f"M={MICROBATCHES} {spec.precision}: median step {median_ms:.2f} ms ({clock}, "
        f"{len(timed)} steps); {len(findings)} reference comparisons, max relative error "
        f"{worst:.1e} (tol {tol:g})"
        + (f"; CUDA allocator peak {peak / 2**20:.1f} MiB" if peak is not None else "")
    )
    ok = not bad and all(t > 0 for t in times) and (not h.cuda or (peak or 0) > 0)
    if bad:
        detail += "; mismatches: " + ", ".join(bad[:3])
    figures = {"median_step_ms": median_ms, "max_rel_error": worst, "tol": tol, "peak": peak}
    return Outcome("v-one-rank", ok, detail, figures)


def check_two_ranks_one_gpu(
    out_dir: str | Path,
    device: str = "cuda",
    sizes: Mapping[str, int] = GPT_SIZES,
    batch: int = BATCH,
    timeout_s: float = 300.0,
) -> Outcome:
    """``vpipe run`` with two gloo ranks on one device, profiled; the traces converted and
    compared with the programs."""
    from vpipe.metrics.catalogue import summarize
    from vpipe.schedules import make_schedule
    from vpipe.trace.kineto import convert

    ranks, name = 2, "two-ranks-one-gpu"
    out = Path(out_dir)
    argv = [sys.executable, "-m", "vpipe", "run", SCHEDULE, "-p", str(ranks)]
    argv += ["-m", str(MICROBATCHES), "--batch", str(batch), "--steps", "3", "--model", "gpt"]
    argv += ["--sizes", ",".join(f"{k}={v}" for k, v in sizes.items())]
    argv += ["--device", device, "--backend", "gloo", "--check", "--profile", str(out)]
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
    trace = convert([out])
    events = trace.events
    program = make_schedule(SCHEDULE, ranks, MICROBATCHES)
    want = {
        rank: sum(len(a.compute_parts()) for a in program.actions[rank] if a.is_compute)
        for rank in range(ranks)
    }
    rows_ok, rows, on_device, n_compute = rows_verdict(events, want, device)
    bubble = summarize(events)["bubble_ratio"]
    usdt = sum("USDT" in line for line in printed.splitlines())
    ok = files == [f"rank{k}.pt.trace.json" for k in range(ranks)] and rows_ok and usdt == 0
    counts = ", ".join(
        f"rank {k} {'/'.join(map(str, rows[k])) or 'none'} (program {want[k]})" for k in want
    )
    detail = (
        f"{SCHEDULE} P={ranks} on one {device} device over gloo: compute rows per profiled "
        f"step {counts}, {on_device} of {n_compute} on the device clock; bubble ratio "
        f"{bubble:.3f}; traces {', '.join(files)}; {usdt} USDT lines printed"
    )
    return Outcome(name, ok, detail, {"bubble_ratio": bubble, "on_device": on_device})


def rows_verdict(
    events: Any, want: Mapping[int, int], device: str
) -> tuple[bool, dict[int, list[int]], int, int]:
    """(ok, compute rows per profiled step of each rank, rows on the device clock, compute
    rows): ok when every rank's every step has its program's ``want[rank]`` rows and, on a
    GPU, every one is on the device clock."""
    from vpipe.events import COMPUTE_KINDS

    compute = events[events["kind"].astype(str).isin(COMPUTE_KINDS)]
    got = compute.groupby(["rank", "step"], observed=True).size()
    rows = {rank: sorted(set(got[rank].tolist())) if rank in got else [] for rank in want}
    on_device = int((compute["clock"].astype(str) == "device").sum())
    clock_ok = device == "cpu" or on_device == len(compute)
    return all(rows[k] == [want[k]] for k in want) and clock_ok, rows, on_device, len(compute)


def probe_device_reference(
    device: str = "cuda", size: int = 8192, repeats: int = 20, nvml_lib: Any = None
) -> Outcome:
    """A fixed matrix product (bf16 on CUDA) timed one at a time (CUDA events; the host clock
    on the CPU, for tests), and the GPU's clocks, temperature, power and slowdown reasons
    (NVML, each figure read on its own: one refused or deprecated call loses that figure
    only): how still a device reference holds here. A measurement, never a pass."""
    import torch

    from vpipe.trace.device_state import nvml, sample

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    ms = sorted(_timed_ms(lambda: a @ b, cuda) for _ in range(repeats))
    med = statistics.median(ms)
    figures: dict = {"matmul_ms": ms, "tflops": 2 * size**3 / (med / 1e3) / 1e12}
    lib = nvml_lib if nvml_lib is not None else nvml()
    index = torch.cuda.current_device() if cuda else 0
    state = sample(index, lib) if lib is not None else {}
    figures.update(state or {"nvml": "unavailable (nvidia-ml-py not installed, or no driver)"})
    nvml_shown = {k: v for k, v in figures.items() if k not in ("matmul_ms", "tflops")}
    detail = (
        f"{size}^3 {str(dtype).removeprefix('torch.')} matmul x{repeats}: median {med:.3f} ms "
        f"({figures['tflops']:.0f} TFLOP/s), spread {ms[0]:.3f}-{ms[-1]:.3f} ms "
        f"({(ms[-1] - ms[0]) / med:.1%}); NVML {nvml_shown}"
    )
    return Outcome("device-reference", None, detail, figures, measurement=True)


def _timed_ms(fn: Callable[[], Any], cuda: bool) -> float:
    """One call of ``fn`` in milliseconds: by a CUDA event pair on the device, else the host."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def summary(outcomes: Sequence[Outcome]) -> str:
    """The closing line: checks passed of those run; measurements and skips said apart
    (a measurement is reported, never counted as a pass)."""
    checks = [o for o in outcomes if not o.measurement and o.ok is not None]
    passed = sum(o.ok is True for o in checks)
    measured = sum(o.measurement for o in outcomes)
    skipped = sum(o.ok is None and not o.measurement for o in outcomes)
    return (f"{passed} of {len(checks)} checks passed; {measured} measurement"
            f"{'s' * (measured != 1)} reported (not checks), {skipped} skipped")  # fmt: skip


def _pack(out: Path, name: str, folders: Sequence[Path]) -> None:
    """``out/name``: a gzipped tar of ``folders`` (what exists of them), by folder name."""
    with tarfile.open(out / name, "w:gz") as tar:
        for f in folders:
            if f.exists():
                tar.add(f, arcname=f.name)


def main(argv: Sequence[str] | None = None) -> int:
    """Every check and the session figures on cuda:0; 0 if all pass, 1 if any fails, 2
    without a CUDA device."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/gpu-check", help="where the eight files go")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}): nothing checked; run it on a GPU machine"
        )
        return 2
    from bench.gpu_device_checks import device_checks, nccl_check
    from bench.gpu_sweeps import session_outcomes

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "gpu-check.txt", "w", encoding="utf-8")  # noqa: SIM115 (written as we go)

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    t0 = time.perf_counter()
    gpu = torch.cuda.get_device_name(0)
    say(f"gpu-check on {gpu} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    outcomes: list[Outcome] = []

    def done(o: Outcome) -> None:
        outcomes.append(o)
        say(f"[{time.perf_counter() - t0:5.0f} s] {o.line()}")

    def guarded(name: str, run: Callable[[], list[Outcome]]) -> None:
        """Run one part; a crash is that part's FAIL line, and the session goes on."""
        try:
            for o in run():
                done(o)
        except Exception as e:  # noqa: BLE001 (reported, and the other checks still run)
            done(Outcome(name, False, f"crashed: {type(e).__name__}: {e}"))

    with tempfile.TemporaryDirectory(prefix="vpipe-gpu-check-") as tmp:
        traces, sweeps = Path(tmp) / "traces", Path(tmp) / "sweeps"
        guarded("device-reference", lambda: [probe_device_reference()])
        guarded("v-one-rank", lambda: [check_v_one_rank()])
        guarded("device-checks", lambda: [Outcome(*o) for o in device_checks(traces)])
        guarded("two-ranks-one-gpu", lambda: [check_two_ranks_one_gpu(traces / "two-ranks")])
        guarded("nccl-two-gpus", lambda: [Outcome(*nccl_check(traces / "nccl", GPT_SIZES, BATCH))])
        guarded("sweeps", lambda: [Outcome(*o) for o in session_outcomes(sweeps, say, t0)])
        _pack(out, "traces.tar.gz", sorted(traces.iterdir()) if traces.exists() else [])
        _pack(out, "sweeps.tar.gz", sorted(sweeps.iterdir()) if sweeps.exists() else [])
    failed = sum(o.ok is False for o in outcomes)
    say(f"gpu-check: {summary(outcomes)} in {time.perf_counter() - t0:.0f} s")
    figures = {"gpu": gpu, "torch": torch.__version__, "checks": [asdict(o) for o in outcomes]}
    (out / "figures.json").write_text(json.dumps(figures, indent=1, default=str))
    log.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
