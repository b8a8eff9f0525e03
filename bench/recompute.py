"""Activation recomputation on CPU: what each mode costs in step time and saves in memory,
vpipe's runtime beside torch.distributed.pipelining with torch.utils.checkpoint.

First, one stage of the GPT model (two decoder blocks) in this process, one thread: the median
time of F, B, I and W per implementation and mode (none, full), interleaved, and what full
recomputation adds to each in forwards of ``none``'s F (vpipe: one forward in B and in I,
none in W; torch's split backward recomputes in W too, per weight-gradient call).

Then one launch (P=2 gloo ranks, GPT model, M=8) builds every config's rank harness: zbv and
interleaved-1f1b x vpipe and torch x recompute none, full and selective (torch refuses
selective checkpointing under zbv's split backward: shown as refused). Each config is warmed
up, metered once (bytes saved for backward), then timed in rounds that alternate the configs'
order, each step's time the slowest rank's; ``--profiles`` profiled steps per config
(default 4; per-action medians: :func:`vpipe.predict.calibrate.calibrate`) are spread over
those rounds, so that the calibration and the timed steps sample the same stretch of the host.
Printed per schedule, implementation and mode:

- the median step time (``step ms``) and the median of pairwise ratios to the same
  implementation's ``none`` with its bootstrap 95% interval (``ratio``), beside the ratio the
  simulator predicts (``sim``);
- what the mode adds in forwards of the ``none`` run: to the step (``step +F``: the step's
  extra time over M forwards of the stages of the rank with the most forward time, from the
  paired ratio and its interval), and to a
  backward (``B|I +F``: B, or I, over the ``none`` run's, per stage, the median over stages but
  stage 0; ``W +F``: W's): full recomputation should cost one forward in B or I and none in W;
- peak bytes per rank: vpipe's own count (what the mode keeps, and what the recomputing
  backward holds), predicted by the simulator from the ``none`` run's per-stage bytes and the
  stages' input shapes, and the saved-tensor meter's (the only figure torch's runs have; it
  does not see what torch's checkpoint keeps inside its own hooks);
- the simulator's step time predicted from the ``none`` run's calibration with the mode's
  recomputation (full: in each B and I, each stage's forward as the ``none`` run's probe timed
  it alone, :func:`vpipe.sweep.split_probe.probe_forwards`; selective: per stage, the share of the
  ``none`` run's forwards spent in the calls selective recomputation reruns, read from its
  ``PP:RECOMPUTABLE`` spans: :mod:`vpipe.predict.recompute_share`), its compute anchored to
  the ``none`` run's timed median (:func:`vpipe.predict.calibrate.anchor`: ``none``'s error
  is 0 by construction), and its
  error against the timed median (``sim ms``, ``err``), and whether the simulator's ratio to
  ``none`` lies inside the measured paired ratio's 95% interval (``sim in CI``: an error the
  timing cannot tell from none).

Run: ``python -m bench.recompute [--rounds 10] [--steps 3] [--batch 64] [--stage-repeats 30]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

SCHEDULES = ("zbv", "interleaved-1f1b")
IMPLS = ("vpipe", "torch")
MODES = ("none", "full", "selective")
SIZES = {"vocab": 512, "d_model": 128, "n_heads": 4, "n_layers": 4, "seq_len": 64}
P, M = 2, 8


def _rank_job(rank: int, n_ranks: int, specs: list, rounds: int, steps: int, profiles: int) -> dict:
    """This rank's figures per config (None where the implementation refused it)."""
    import torch.distributed as dist

    from vpipe.errors import VpipeError
    from vpipe.sweep.harness import build

    hs: list[Any] = []
    for spec in specs:
        try:
            hs.append(build(spec, rank))
        except VpipeError as e:
            hs.append(str(e).splitlines()[0])
    live = [i for i, h in enumerate(hs) if not isinstance(h, str)]
    out: dict[str, Any] = {"refused": {i: h for i, h in enumerate(hs) if isinstance(h, str)}}
    for i in live:
        hs[i].timed_step()
        hs[i].timed_step()
    out["memory"] = {i: hs[i].memory_step() for i in live}
    # each stage's forward alone (what a full recomputation reruns), on the runs that keep
    # their activations: vpipe.sweep.split_probe.probe_forwards
    out["forwards"] = {i: hs[i].forward_probe() for i in live}
    for v in out["memory"].values():
        v.pop("samples", None)
    out["stages"] = {
        i: {s: (st.act_bytes, st.recompute_bytes) for s, st in hs[i].pipe.stages.items()}
        for i in live
        if specs[i].impl == "vpipe"
    }
    out["events"] = {i: [] for i in live}
    times: dict[int, list[float]] = {i: [] for i in live}
    # the profiled steps spread over the timed rounds, as a sweep does, so that calibration and
    # timing sample the same stretch of a host whose speed drifts
    profile_in = [k * rounds // profiles for k in range(profiles)]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = live if r % 2 == 0 else live[::-1]
            for i in order:
                for _ in range(steps):
                    times[i].append(hs[i].timed_step())
            for k in (k for k, at in enumerate(profile_in) if at == r):
                for i in order:
                    meta = {"run_id": f"c{i}", "impl": specs[i].impl,
                            "schedule": specs[i].schedule.name}  # fmt: skip
                    dist.barrier()
                    out["events"][i].append(hs[i].profiled_step(f"{tmp}/c{i}-{k}", meta))
    out["times"] = times
    return out


def _specs(batch: int) -> list:
    from vpipe.schedules import make_schedule
    from vpipe.sweep.harness import RankSpec

    specs = []
    for name in SCHEDULES:
        base = RankSpec(make_schedule(name, P, M), model="gpt", sizes=SIZES, batch=batch)
        specs += [replace(base, impl=i, recompute=m) for i in IMPLS for m in MODES]
    return specs


def _kept_bytes(spec: Any, stage: int, act: float, mode: str) -> tuple[float, float]:
    """Predicted (kept by F, held by the recomputing backward) of a stage, from the ``none``
    run's bytes ``act`` and the model's shapes (float32)."""
    d, t, h = SIZES["d_model"], SIZES["seq_len"], SIZES["n_heads"]
    rows = spec.batch // M
    hidden = rows * t * d * 4
    if mode == "full":  # the stage's input: stage 0's is its token ids (int64)
        kept = rows * t * 8 if stage == 0 else hidden
        # the none run counts stage 0's tokens as the batch's (its microbatch is a view)
        return kept, act - kept - (spec.batch - rows) * t * 8 * (stage == 0)
    from vpipe.models import build_model

    stages = build_model("gpt", spec.schedule.n_stages, 0, **SIZES).stages
    blocks = sum(type(p).__name__ == "DecoderBlock" for p in stages[stage].pieces)
    lazy = blocks * 4 * hidden  # the GELU outputs
    attention = blocks * rows * h * t * 4  # its core's log-sum-exp (the output: proj's input)
    return act - lazy - attention, lazy


def _predicted_peaks(spec: Any, act: dict[int, float], mode: str) -> list[float]:
    from vpipe.sim import CostModel, simulate

    n = spec.schedule.n_stages
    if mode == "none":
        kept, rec = [act[s] for s in range(n)], [0.0] * n
    else:
        kept, rec = zip(*(_kept_bytes(spec, s, act[s], mode) for s in range(n)), strict=True)
    costs = CostModel(activation_bytes=list(kept), recompute_bytes=list(rec))
    return simulate(spec.schedule, costs).peak_activation_bytes


def _backward_extra(cal: Any, base: Any) -> tuple[float, float]:
    """Median over stages of (backward time - the none run's) / the none run's forward, for
    I (or B) and for W (0 for a B-only schedule)."""
    import numpy as np

    split = base.w_share is None  # I and W were measured apart
    if split:
        i_extra, w_extra = (cal.b - base.b) / base.f, (cal.w - base.w) / base.f
        return float(np.median(i_extra[1:])), float(np.median(w_extra))
    b_extra = ((cal.b + cal.w) - (base.b + base.w)) / base.f
    return float(np.median(b_extra)), 0.0


def measure(rounds: int, steps: int, batch: int, profiles: int) -> tuple[list, list[dict]]:
    """Every config's spec, and each rank's figures (one launch)."""
    from vpipe.runtime.launch import spawn

    specs = _specs(batch)
    return specs, spawn(_rank_job, P, specs, rounds, steps, profiles, timeout_s=3000)


def report(specs: list, per_rank: list[dict], rounds: int, steps: int, batch: int) -> list[str]:
    """The benchmark's printed lines."""
    import numpy as np
    import pandas as pd

    from vpipe.predict.calibrate import anchor, calibrate
    from vpipe.predict.recompute_share import full_shares, selective_shares
    from vpipe.sim import simulate
    from vpipe.stats import paired_ratio
    from vpipe.sweep.split_probe import forwards_us

    def events(i: int) -> Any:
        return pd.concat([e for r in per_rank for e in r["events"][i]], ignore_index=True)

    lines = [
        f"GPT {SIZES}, batch {batch}, P={P}, M={M}, {rounds} rounds x {steps} steps per config; "
        "ratio: median of pairwise ratios to the same implementation's none (95% CI)",
        f"{'schedule':17s} {'impl':5s} {'mode':9s} {'step ms':>8s} {'ratio':>22s} "
        f"{'sim':>5s} {'step +F (95% CI)':>18s} {'B|I +F':>6s} {'W +F':>5s} {'peak/rank (count)':>19s} "
        f"{'predicted':>19s} {'meter':>19s} {'sim ms':>7s} {'err':>6s} {'sim in CI':>9s}",
    ]
    kib = lambda xs: "/".join(f"{x / 1024:.0f}" for x in xs) + " KiB"  # noqa: E731
    shares: list[str] = []
    for i, spec in enumerate(specs):
        name, impl, mode = spec.schedule.name, spec.impl, spec.recompute
        head = f"{name:17s} {impl:5s} {mode:9s}"
        if i in per_rank[0]["refused"]:
            lines.append(f"{head} refused: {per_rank[0]['refused'][i][:100]}")
            continue
        base = specs.index(replace(spec, recompute="none"))
        slowest = list(map(max, *(r["times"][i] for r in per_rank)))
        base_slowest = list(map(max, *(r["times"][base] for r in per_rank)))
        cal, none_s = calibrate(events(i)), statistics.median(base_slowest)
        alone = forwards_us(r["forwards"][base] for r in per_rank)  # vpipe's runs: probed
        cal_base = calibrate(events(base), forward_alone=None if alone is None else
                             np.array(alone, dtype=float))  # fmt: skip
        cal_base = anchor(cal_base, spec.schedule, none_s)  # none's timed level
        ratio = paired_ratio(slowest, base_slowest)
        extra_bi, extra_w = _backward_extra(cal, cal_base)
        cm = cal_base.cost_model(spec.schedule)
        n = spec.schedule.n_stages
        share = {"none": 0.0, "full": full_shares(cal_base, n, n),
                 "selective": selective_shares(cal_base, n, n)}[mode]  # fmt: skip
        cm = replace(
            cm, recompute=share if mode == "none" else list(np.atleast_1d(share) * np.ones(n))
        )
        sim_ms = simulate(spec.schedule, cm).makespan / 1e3
        sim_ratio = sim_ms / (simulate(spec.schedule, replace(cm, recompute=0.0)).makespan / 1e3)
        step_ms = statistics.median(slowest) * 1e3
        # the step's extra time in forwards (M of each stage's on the rank with the most),
        # from the paired ratio to none and its interval: steps timed side by side
        by_rank = [sum(cal_base.f[s] for s in spec.schedule.stages_of(r)) for r in range(P)]
        per = none_s * 1e3 / (M * max(by_rank) / 1e3)
        step_f = f"{(ratio.value - 1) * per:5.2f} ({(ratio.low - 1) * per:5.2f}-{(ratio.high - 1) * per:4.2f})"
        if mode != "none":
            shares.append(f"{mode} {name} {impl}: " + "/".join(f"{x:.2f}" for x in cm.recompute))
        meter = [r["memory"][i]["peak_bytes"] for r in per_rank]
        count = predicted = "-"
        if impl == "vpipe":
            peaks = [r["memory"][i]["runtime_peak_bytes"] for r in per_rank]
            act = {s: a for r in per_rank for s, (a, _) in r["stages"][base].items()}
            count, predicted = kib(peaks), kib(_predicted_peaks(spec, act, mode))
        lines.append(
            f"{head} {step_ms:8.1f} {ratio.value:7.3f} ({ratio.interval_text(3):>12s}) "
            f"{sim_ratio:5.3f} {step_f:>18s} {extra_bi:6.2f} {extra_w:5.2f} {count:>19s} "
            f"{predicted:>19s} {kib(meter):>19s} "
            f"{sim_ms:7.1f} {100 * (sim_ms / step_ms - 1):+5.1f}% "
            f"{'yes' if ratio.low <= sim_ratio <= ratio.high else 'no':>9s}"
        )
    lines.append("what each B or I reruns, in shares of the none run's F per stage (full: the "
                 "forward alone, as probed; selective: its RECOMPUTABLE spans): "
                 + "; ".join(shares))  # fmt: skip
    return lines


def stage_times(repeats: int, rows: int) -> dict[tuple[str, str], dict[str, float]]:
    """Median ms of F, B, I and W of one GPT stage (two decoder blocks, one thread) per
    (implementation, mode), modes and implementations interleaved in every repeat: vpipe's
    Stage, and torch.distributed.pipelining's stage backward helpers on the module under
    torch.utils.checkpoint."""
    import time

    import torch
    from torch.distributed.pipelining._backward import (
        stage_backward,
        stage_backward_input,
        stage_backward_weight,
    )

    from vpipe.baselines.checkpointing import checkpointed
    from vpipe.models import build_model
    from vpipe.runtime.stage import Stage

    torch.set_num_threads(1)
    module = build_model("gpt", 4, 0, **SIZES).stages[1]  # the middle: two decoder blocks
    params = list(module.parameters())
    x0 = torch.randn(rows, SIZES["seq_len"], SIZES["d_model"])
    g = torch.randn_like(x0)
    meta = ((tuple(x0.shape), x0.dtype),)
    stages = {m: Stage(1, 4, module, None, m) for m in ("none", "full")}
    for st in stages.values():
        st.set_meta(meta, meta)
    wrapped = {m: checkpointed(module, m) for m in ("none", "full")}

    def clock(fn: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3

    def vpipe_round(mode: str) -> dict[str, float]:
        st, got = stages[mode], {}
        _, got["F"] = clock(lambda: st.forward(0, (x0.clone(),), None))
        _, got["B"] = clock(lambda: st.backward(0, (g,)))
        st.forward(1, (x0.clone(),), None)
        _, got["I"] = clock(lambda: st.backward_input(1, (g,)))
        _, got["W"] = clock(lambda: st.backward_weight(1))
        return got

    def torch_round(mode: str) -> dict[str, float]:
        mod, got = wrapped[mode], {}
        x = x0.clone().requires_grad_(True)
        out, got["F"] = clock(lambda: mod(x))
        _, got["B"] = clock(lambda: stage_backward(out, g, [x]))
        x = x0.clone().requires_grad_(True)
        out = mod(x)
        (_, groups), got["I"] = clock(lambda: stage_backward_input([out], [g], [x], iter(params)))
        _, got["W"] = clock(lambda: stage_backward_weight(iter(params), groups))
        return got

    runs = {("vpipe", m): partial(vpipe_round, m) for m in stages}
    runs |= {("torch", m): partial(torch_round, m) for m in wrapped}
    times: dict[tuple[str, str], dict[str, list[float]]] = {k: {} for k in runs}
    for r in range(repeats + 3):  # three warm-up repeats
        for key in list(runs) if r % 2 else list(runs)[::-1]:
            for p in params:
                p.grad = None
            for kind, ms in runs[key]().items():
                times[key].setdefault(kind, []).append(ms) if r >= 3 else None
    return {k: {kind: statistics.median(v) for kind, v in t.items()} for k, t in times.items()}


def stage_lines(repeats: int, rows: int) -> list[str]:
    """The stage-level table: each part's median and full recomputation's extra in forwards."""
    med = stage_times(repeats, rows)
    lines = [
        f"one GPT stage (2 blocks, {rows} rows x {SIZES['seq_len']} tokens, 1 thread), "
        f"{repeats} interleaved repeats, median ms; full's extra over none in none's forwards",
        f"{'mode':5s} {'impl':5s} {'F':>6s} {'B':>6s} {'I':>6s} {'W':>6s} "
        f"{'B +F':>5s} {'I +F':>5s} {'W +F':>5s}",
    ]
    for impl in IMPLS:
        base = med[impl, "none"]
        for mode in ("none", "full"):
            t = med[impl, mode]
            extra = [(t[k] - base[k]) / base["F"] for k in ("B", "I", "W")]
            lines.append(
                f"{mode:5s} {impl:5s} "
                + " ".join(f"{t[k]:6.2f}" for k in ("F", "B", "I", "W"))
                + " "
                + " ".join(f"{e:5.2f}" for e in extra)
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.recompute", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (configs alternate)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per config and round")
    p.add_argument("--batch", type=int, default=64, help="global batch (M=8 microbatches)")
    p.add_argument("--profiles", type=int, default=4, help="profiled steps per config")
    p.add_argument("--stage-repeats", type=int, default=30, help="repeats of the stage table")
    args = p.parse_args(argv)
    for line in stage_lines(args.stage_repeats, args.batch // M):
        print(line, flush=True)
    specs, per_rank = measure(args.rounds, args.steps, args.batch, args.profiles)
    for line in report(specs, per_rank, args.rounds, args.steps, args.batch):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
