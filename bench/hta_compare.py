"""Per-rank idle time of the same traces read by HolisticTraceAnalysis (HTA) and by vpipe.

HTA is what people use to read PyTorch traces; this prints its per-rank idle time beside
vpipe's for the same files, and the definitions, which differ (:data:`DEFINITIONS`): HTA reads
the GPU side only, per rank from its first GPU op to its last and per stream, while vpipe's
bubble is per rank over its step, idle being what its compute rows (F, B, I, W) leave. A
CPU-only trace has no GPU ops, so HTA has no idle time to give for it; the script says what
HTA did read there.

Run: ``python -m bench.hta_compare DIR [DIR ...]`` (directories of one run's per-rank traces,
``.json`` or ``.json.gz``), or ``--record DIR`` to first record a small CPU run of torch's own
runtime (torch.distributed.pipelining's ScheduleInterleaved1F1B on 2 gloo ranks under
torch.profiler; vpipe only starts the processes) into ``DIR/torch-interleaved-1f1b`` and read
it too. Without HTA installed the vpipe side still prints, with one line saying how to
install HTA (``pip install 'vpipe[hta]'``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd

from vpipe.errors import VpipeError

INSTALL = "pip install 'vpipe[hta]' (HolisticTraceAnalysis and psutil)"


def vpipe_idle(trace_dir: str | Path) -> pd.DataFrame:
    """vpipe's figures per rank (the last profiled step): window, busy, idle and device busy
    in ms, and the bubble."""
    from vpipe.events import COMPUTE_KINDS
    from vpipe.metrics.per_run import rank_metrics
    from vpipe.trace.kineto import convert

    ev = convert([trace_dir]).events
    per_rank = rank_metrics(ev)
    per_rank = per_rank[per_rank["step"] == per_rank["step"].max()].set_index("rank")
    compute = ev[ev["kind"].astype(str).isin(COMPUTE_KINDS) & (ev["step"] == per_rank["step"].max())]
    on_device = compute[compute["clock"].astype(str) == "device"]
    device_busy = on_device.groupby("rank", observed=True)["busy_ns"].sum() / 1e6
    return pd.DataFrame(
        {
            "vpipe window": per_rank["window_s"] * 1e3,
            "vpipe busy": per_rank["busy_s"] * 1e3,
            "vpipe idle": per_rank["idle_s"] * 1e3,
            "vpipe bubble": per_rank["bubble_ratio"],
            "vpipe dev busy": device_busy.reindex(per_rank.index),
        }
    ).rename_axis("rank")


def hta_idle(trace_dir: str | Path) -> tuple[pd.DataFrame | None, str]:
    """HTA's per-rank GPU figures in ms (kernel span, idle, compute, non-compute, idle share,
    and each rank's idle split by category over its streams), or None and why not."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError as e:
        return None, f"HTA is not installed ({e.name} missing): {INSTALL}"
    with _quiet():  # HTA prints a few lines per file it parses, from its worker processes too
        try:
            analysis = TraceAnalysis(trace_dir=str(trace_dir))
        except Exception as e:  # HTA's own errors on traces it cannot read
            return None, f"HTA could not read {trace_dir}: {type(e).__name__}: {e}"
        ranks = sorted(int(r) for r in analysis.t.traces)
        kernels = sum(int((analysis.t.get_trace(r)["stream"] >= 0).sum()) for r in ranks)
        if not kernels:
            events = ", ".join(f"rank {r}: {len(analysis.t.get_trace(r))}" for r in ranks)
            return None, (
                f"HTA parsed these traces (events in profiler step(s) "
                f"{[int(s) for s in analysis.get_profiler_steps()]}: {events}) but they hold "
                "no GPU kernels: its temporal and idle-time breakdowns measure GPU streams "
                "only, so HTA gives no idle time for a CPU trace"
            )
        temporal = analysis.get_temporal_breakdown(visualize=False)
        idle = analysis.get_idle_time_breakdown(ranks=ranks, visualize=False)
    t = temporal.set_index("rank")
    out = pd.DataFrame(
        {
            "HTA span": t["kernel_time(us)"] / 1e3,
            "HTA idle": t["idle_time(us)"] / 1e3,
            "HTA compute": t["compute_time(us)"] / 1e3,
            "HTA non-compute": t["non_compute_time(us)"] / 1e3,
            "HTA busy": (t["compute_time(us)"] + t["non_compute_time(us)"]) / 1e3,
            "HTA idle share": t["idle_time_pctg"] / 100,
        }
    )
    idle = idle[0] if isinstance(idle, tuple) else idle
    by_cat = idle.groupby(["rank", "idle_category"])["idle_time"].sum().unstack(fill_value=0)
    for cat in by_cat.columns:
        out[f"HTA {cat.replace('_', ' ')}*"] = by_cat[cat] / 1e3
    return out.rename_axis("rank"), ""


@contextmanager
def _quiet() -> Iterator[None]:
    """Standard output and error, this process's and its children's, dropped meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)


def raw_gpu_ops(trace_dir: str | Path) -> pd.Series:
    """Per rank, the union of every GPU op in its file (kernels, copies, memsets), in ms, read
    from the JSON directly: what both readers start from. Empty for CPU traces."""
    out = {}
    paths = sorted(p for p in Path(trace_dir).iterdir() if p.name.endswith((".json", ".json.gz")))
    for i, path in enumerate(paths):
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            doc = json.load(f)
        if not isinstance(doc, dict):
            continue
        events = doc.get("traceEvents", [])
        rank = doc.get("distributedInfo", {}).get("rank", i)
        spans = sorted(
            (e["ts"], e["ts"] + e["dur"]) for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        )  # fmt: skip
        total, end = 0.0, float("-inf")
        for a, b in spans:
            total += max(0.0, b - max(a, end))
            end = max(end, b)
        if spans:
            out[int(rank)] = total / 1e3
    return pd.Series(out, name="raw GPU ops", dtype=float)


def compare(trace_dir: str | Path) -> tuple[pd.DataFrame, str]:
    """vpipe's and HTA's per-rank figures for one run's traces side by side (with the union of
    the files' GPU ops), and HTA's note (empty when it read them)."""
    table = vpipe_idle(trace_dir)
    raw = raw_gpu_ops(trace_dir)
    if len(raw):
        table = table.join(raw)
    theirs, note = hta_idle(trace_dir)
    if theirs is not None:
        table = table.join(theirs, how="outer")
    return table.reset_index(), note


# ---------------------------------------------------------------------------------------------
# A CPU trace written by torch's own runtime


def _record_rank(rank: int, n_ranks: int, out: str, n_microbatches: int, width: int) -> str:
    """One rank of torch's ScheduleInterleaved1F1B (2 stages per rank, loop placement) on an
    MLP, profiled by torch.profiler (wait 1, warm-up 1, active 1), its trace written as
    ``rank{N}_trace.json`` as torchtitan names them."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.profiler import ProfilerActivity, profile, schedule

    n_stages = 2 * n_ranks
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        for _ in range(n_stages)
    ]
    mine = [s for s in range(n_stages) if s % n_ranks == rank]
    stages = [PipelineStage(blocks[s], s, n_stages, torch.device("cpu")) for s in mine]
    pipe = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=nn.functional.mse_loss)
    x = torch.randn(16 * n_microbatches, width)
    y = torch.randn(16 * n_microbatches, width)
    path = Path(out) / f"rank{rank}_trace.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for _ in range(3):
            kwargs: dict[str, Any] = {}
            if 0 in mine:
                kwargs["x"] = x
            if n_stages - 1 in mine:
                kwargs["target"] = y
            args = (kwargs.pop("x"),) if "x" in kwargs else ()
            pipe.step(*args, **kwargs)
            prof.step()
    return str(path)


def record_torch_cpu(out: str | Path, n_microbatches: int = 4, width: int = 256) -> Path:
    """Record a 2-rank CPU run of torch's own pipelining runtime into ``out`` (made if
    needed); returns the directory of its two traces."""
    from vpipe.runtime.launch import spawn
    from vpipe.trace.quiet import filtered_stderr

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    with filtered_stderr():  # the profiler's start and stop lines
        spawn(_record_rank, 2, str(d), n_microbatches, width, timeout_s=300)
    return d


DEFINITIONS = """\
Times in ms, per rank, over the profiled step.
vpipe window: the rank's step span (PP:STEP; without one, the step's extent over all ranks);
  busy: the union of its compute rows (F, B, I, W; on a GPU each from its first device op to its
  last, gaps between them included); idle = window - busy; bubble = idle / window.
vpipe dev busy: the sum of the compute rows' busy_ns, the union of the GPU ops each launched.
raw GPU ops: the union of every kernel, copy and memset in the rank's file, read here from the JSON.
HTA span: the rank's first GPU op to its last, all streams; HTA busy: the union of its GPU ops
  (HTA rounds each op's start and length down to whole microseconds); HTA idle = span - busy;
  compute: compute kernels; non-compute: the rest (communication, copies, memsets).
HTA host wait*, kernel wait*, other*: get_idle_time_breakdown's categories of each stream's idle
  time (the GPU waiting for the host to launch; short gaps between kernels; the rest), summed
  over the rank's streams, so a gap on two streams counts twice."""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.hta_compare", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("dirs", nargs="*", help="directories of one run's per-rank traces each")
    p.add_argument("--record", metavar="DIR", help="record torch's runtime on the CPU into DIR "
                   "first (DIR/torch-interleaved-1f1b) and read it too")  # fmt: skip
    args = p.parse_args(argv)
    dirs = [Path(d) for d in args.dirs]
    if not dirs and not args.record:
        p.error("give trace directories, or --record DIR")
    for d in dirs:
        if not d.is_dir():
            p.error(f"{d}: not a directory of traces")
    if args.record:
        dirs.append(record_torch_cpu(Path(args.record) / "torch-interleaved-1f1b"))
    command = shlex.join(["python", "-m", "bench.hta_compare", *(argv or sys.argv[1:])])
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{when} on {platform.node()}: {command}")
    pd.set_option("display.width", 250)
    failed = 0
    for d in dirs:
        try:
            table, note = compare(d)
        except VpipeError as e:  # not a run's traces: say so, go on with the others
            print(f"{d}: vpipe cannot read it: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"\n{d}:")
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        if note:
            print(note)
    print("\n" + DEFINITIONS)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
