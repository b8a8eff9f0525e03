"""Predicted against published: the cluster planner's tokens/s per GPU for every row of the
3D-parallel development tables, the error per source (median and worst), and with
``--held-out`` each row predicted by terms fitted without it, whose median error per machine is
the planner's tie band (:data:`vpipe.sim.efficiency.MEASURED_ERROR`).

Reads ``dev-tables.json`` of ``shared/data/3d-parallel`` (described in the README beside it):
Megatron-LM's H100 weak-scaling table, NeMo 24.07's FP8 H100 rows with PP, the Megatron-LM
paper's A100 Table 1 (full recomputation) and one 22B layer's times under each recomputation
setting (Korthikanti et al. 2022, Table 4). Each throughput row's layout (TP, PP, CP, DP,
virtual stages, global batch, sequence, model shape) goes in; its published figure is only
compared with. Published TFLOP/s are turned into tokens/s per GPU with the source's own FLOP
formula (Megatron-LM: ``72 B s l h^2 (1 + s/6h + V/12lh)`` per iteration; the paper:
``96 B s l h^2 (1 + s/6h + V/16lh)``, which counts the recomputed forward).

Not printed by the sources, and so assumed here (each also a line of the output): microbatch 1
where none is given; Megatron's H100 rows in bf16 without recomputation, 1F1B (interleaved
with 2 stages per rank for the paper's rows with PP > 1, 1F1B with none); NeMo's rows without
recomputation, interleaved with their virtual stages; the distributed optimizer (``shard
optimizer``) everywhere. Nemotron-22B's shape is not published: its row is left out.

``--fit`` fits the efficiency terms of :mod:`vpipe.sim.efficiency` per machine (a peak share
per precision, ``d_half`` and ``tp_hidden``) to these rows: a grid over ``d_half`` and
``tp_hidden``, and for each the peak share (at most 1) that makes the median of the
predicted-to-published ratio 1; a few terms per machine, never one per row. Without ``--fit`` it checks the terms in the code.

``--held-out`` also predicts each row with terms fitted on its machine's other rows (leave one
row out): the in-sample table says how well the model's shape follows the rows, this how a
row the fit never saw fares.

Run: ``python -m bench.cluster_published [PATH] [--fit] [--held-out]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.published import find_data
from vpipe.predict.cluster_eval import evaluate
from vpipe.schedules import catalogue
from vpipe.sim.arch import PRESETS as ARCHS
from vpipe.sim.arch import Arch
from vpipe.sim.efficiency import FITS, Fit
from vpipe.sim.machine import PRESETS as MACHINES
from vpipe.sim.model_costs import (
    MEMORY_EFFICIENCY,
    Layout,
    Rates,
    block_comm_s,
    model_costs,
    stage_parts,
)
from vpipe.sim.parallel import Split, block_on_gpu

DATA = Path("shared") / "data" / "3d-parallel" / "dev-tables.json"
MACHINE = {"megatron_h100": "h100", "nemo_24_07": "h100", "narayanan_2021": "a100",
           "korthikanti_2022_t4": "a100"}  # fmt: skip
NEMO = {
    "GPT3-175B": ARCHS["gpt3-175b"][0],
    "LLAMA2-70B": ARCHS["llama2-70b"][0],
    "LLAMA3-70B": ARCHS["llama3-70b"][0],
    "LLAMA2-13B": Arch("llama2-13b", layers=40, hidden=5120, heads=40, ffn=13824, seq_len=4096,
                       vocab=32000, gated_mlp=True, tied_embeddings=False),
    "Nemotron-340B": Arch("nemotron-340b", layers=96, hidden=18432, heads=96, kv_heads=8,
                          ffn=73728, seq_len=4096, vocab=256000, tied_embeddings=False),
}  # fmt: skip
ASSUMED = [
    "microbatch 1 where the source gives none",
    "megatron_h100: bf16, no recomputation, 1f1b, untied embeddings",
    "nemo_24_07: no recomputation, interleaved-1f1b with the row's virtual stages",
    "narayanan_2021: fp16, dropout, no flash attention, interleaved-1f1b with 2 stages per "
    "rank when PP > 1",
    "every throughput row: the distributed optimizer (shard optimizer), sync optimizer step",
    "megatron_h100 and nemo_24_07: the data-parallel reduction overlapped with the backward "
    "(--overlap-grad-reduce); narayanan_2021: after the pipeline's flush",
    "megatron_h100, nemo_24_07 and korthikanti_2022_t4: the backward's TP collectives beside "
    "its weight-gradient GEMMs (asynchronous TP communication); narayanan_2021: after them",
]


def gpt(row: dict[str, Any], **kw: Any) -> Arch:
    return Arch(row["model"], layers=row["layers"], hidden=row["hidden"], heads=row["heads"],
                seq_len=row["seq_len"], vocab=row.get("vocab", 51200), **kw)  # fmt: skip


def setup(row: dict[str, Any]) -> dict[str, Any] | None:
    """What goes in for a throughput row: the model, layout, schedule, batch and the published
    tokens/s per GPU to compare with (None for a row this benchmark cannot model)."""
    src = row["source"]
    if src == "megatron_h100":
        arch = gpt(row, tied_embeddings=False)
        b, s, l, h, v = row["global_batch"], row["seq_len"], row["layers"], row["hidden"], row["vocab"]
        flops = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
        tokens = row["tflops_per_gpu"] * 1e12 * b * s / flops
        return dict(arch=arch, tp=row["tp"], pp=row["pp"], cp=1, dp=row["dp"], v=1,
                    schedule="1f1b", recompute="none", batch=b, published=tokens,
                    overlap=True, async_tp=True)  # fmt: skip
    if src == "nemo_24_07":
        if row["model"] not in NEMO:
            return None
        arch = replace(NEMO[row["model"]], seq_len=row["seq_len"], precision="fp8",
                       dropout=False)  # fmt: skip
        group = row["tp"] * row["pp"] * row["cp"]
        return dict(arch=arch.with_microbatch(row["microbatch"]), tp=row["tp"], pp=row["pp"],
                    cp=row["cp"], dp=row["gpus"] // group, v=row["virtual_stages"],
                    schedule="interleaved-1f1b", recompute="none", batch=row["global_batch"],
                    published=row["tokens_per_s_per_gpu"], overlap=True, async_tp=True)  # fmt: skip
    if src == "narayanan_2021":
        arch = gpt(row, precision="fp16", dropout=True, flash_attention=False,
                   learned_positions=True)  # fmt: skip
        b, s, l, h, v = row["global_batch"], row["seq_len"], row["layers"], row["hidden"], row["vocab"]
        flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        tokens = row["tflops_per_gpu_incl_recompute"] * 1e12 * b * s / flops
        pp = row["pp"]
        return dict(arch=arch, tp=row["tp"], pp=pp, cp=1, dp=row["dp"], v=2 if pp > 1 else 1,
                    schedule="interleaved-1f1b" if pp > 1 else "1f1b", recompute="full",
                    batch=b, published=tokens, overlap=False, async_tp=False)  # fmt: skip
    return None


def predict(row_setup: dict[str, Any], machine_name: str, fit: Fit) -> float:
    """Predicted tokens/s per GPU of one row with efficiency terms ``fit``."""
    st = row_setup
    arch, machine = st["arch"], MACHINES[machine_name]
    layout = Layout(st["pp"], st["dp"], st["v"], "loop", True, "optimizer", st["tp"], st["cp"],
                    st["recompute"], st["overlap"], st["async_tp"])  # fmt: skip
    rates = Rates.for_shapes(machine, arch, st["tp"], st["cp"], fit)
    costs = model_costs(arch, machine, layout, rates, fit)
    fam = catalogue.get(st["schedule"])
    m = st["batch"] // st["dp"] // arch.microbatch
    cand = evaluate(costs, fam, m, st["batch"], math.inf, False)
    return cand.tokens_per_s_per_gpu


LAYER_SETTINGS = {"no recompute": ("none", False), "sequence parallel": ("none", True),
                  "full recompute": ("full", False), "selective recompute": ("selective", False),
                  "selective recompute + sequence parallel": ("selective", True)}  # fmt: skip


def layer_times(row: dict[str, Any], fit: Fit) -> tuple[float, float]:
    """Predicted (forward, backward) ms of one 22B layer on one GPU of its TP group: F; and
    the fused backward (I and W as one pass, I's collectives beside W's GEMMs) with what
    recomputation adds and TP's collectives."""
    arch = gpt({**row, "vocab": 51200}, precision="fp16", dropout=True, flash_attention=False)
    arch = arch.with_microbatch(row["microbatch"])
    recompute, sp = LAYER_SETTINGS[row["setting"]]
    machine = MACHINES["a100"]
    blk = block_on_gpu(arch, Split(tp=row["tp"], sp=sp, recompute=recompute))
    rates = Rates.for_shapes(machine, arch, row["tp"], 1, fit)
    lay = Layout(1, tp=row["tp"], recompute=recompute)
    comm = block_comm_s(machine, lay, blk, rates, fit.tp_hidden)
    bw = machine.memory_bandwidth * MEMORY_EFFICIENCY
    f, i, w = (sum(stage_parts(k, 1, blk, comm, rates, bw).values()) for k in "FIW")
    return f * 1e3, (i + w - comm["hidden_in_b"]) * 1e3


def rows_of(data: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for row in data["rows"]:
        st = setup(row)
        if st is not None:
            out.append({"row": row, "setup": st, "machine": MACHINE[row["source"]]})
    return out


def errors(rows: list[dict[str, Any]], fits: dict[str, Fit]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        pred = predict(r["setup"], r["machine"], fits[r["machine"]])
        out.append({**r, "predicted": pred, "error": pred / r["setup"]["published"] - 1})
    return out


D_HALF = (0, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
TP_HIDDEN = (0.0, 0.25, 0.5, 0.65, 0.8, 0.9, 1.0)


def fit_machine(rows: list[dict[str, Any]], machine: str) -> Fit:
    """The ``d_half`` and ``tp_hidden`` of the grids, and the peak share per precision (the
    median ratio's, at most 1), that give the smallest median |log error| over the machine's
    rows."""
    mine = [r for r in rows if r["machine"] == machine]
    return _best_fit(_unit_ratios(mine, machine), range(len(mine)))


def _unit_ratios(mine: list[dict[str, Any]], machine: str) -> dict[tuple, list[tuple]]:
    """(d_half, tp_hidden) -> each row's (precision, published over predicted at a peak share
    of 1)."""
    out = {}
    for d_half in D_HALF:
        for hidden in TP_HIDDEN:
            unit = Fit({p: 1.0 for p in ("bf16", "fp16", "fp8")}, d_half, "", hidden)
            out[d_half, hidden] = [(r["setup"]["arch"].precision, r["setup"]["published"]
                                    / predict(r["setup"], machine, unit)) for r in mine]  # fmt: skip
    return out


def _best_fit(ratios_by_terms: dict[tuple, list[tuple]], keep: Sequence[int]) -> Fit:
    """The grid point and peak shares that fit the rows ``keep`` best (see fit_machine)."""
    best = None
    for (d_half, hidden), all_ratios in ratios_by_terms.items():
        ratios = [all_ratios[k] for k in keep]
        share = {p: statistics.median(x for q, x in ratios if q == p)
                 for p in {q for q, _ in ratios}}  # fmt: skip
        if max(share.values()) > 1:
            continue
        miss = statistics.median(abs(math.log(x / share[p])) for p, x in ratios)
        if best is None or miss < best[0]:
            best = (miss, d_half, hidden, share)
    _, d_half, hidden, share = best
    if "bf16" in share or "fp16" in share:
        half = share.get("bf16", share.get("fp16"))
        share = {"bf16": half, "fp16": half, **{k: v for k, v in share.items() if k == "fp8"}}
    return Fit({k: round(v, 3) for k, v in share.items()}, d_half, "fitted here", hidden)


def held_out(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row predicted by terms fitted on its machine's other rows (leave one row out): the
    error a row the fit never saw gets, as a kept-apart run would."""
    out = []
    for machine in sorted({r["machine"] for r in rows}):
        mine = [r for r in rows if r["machine"] == machine]
        table_ = _unit_ratios(mine, machine)
        for k, r in enumerate(mine):
            fit = _best_fit(table_, [j for j in range(len(mine)) if j != k])
            pred = predict(r["setup"], machine, fit)
            out.append({**r, "predicted": pred, "error": pred / r["setup"]["published"] - 1})
    return out


def table(out: list[dict[str, Any]]) -> str:
    lines = [f"{'source':<16}{'model':<15}{'tp':>3}{'pp':>4}{'cp':>3}{'dp':>4}{'v':>3}"
             f"{'tok/s/GPU pred':>16}{'published':>11}{'error':>8}"]  # fmt: skip
    for r in out:
        st, row = r["setup"], r["row"]
        lines.append(f"{row['source']:<16}{row['model']:<15}{st['tp']:>3}{st['pp']:>4}"
                     f"{st['cp']:>3}{st['dp']:>4}{st['v']:>3}{r['predicted']:>16.1f}"
                     f"{st['published']:>11.1f}{r['error']:>+8.1%}")  # fmt: skip
    return "\n".join(lines)


def by_source(out: list[dict[str, Any]], key: str) -> dict[str, tuple[int, float, float]]:
    groups: dict[str, list[float]] = {}
    for r in out:
        groups.setdefault(r[key] if key in r else r["row"][key], []).append(abs(r["error"]))
    return {k: (len(v), statistics.median(v), max(v)) for k, v in groups.items()}


def _print_errors(out: list[dict[str, Any]], per_source: str, per_machine: str) -> None:
    """Median and worst |error| of ``out``, per source then per machine."""
    print(per_source)
    for src, (n, med, worst) in by_source(out, "source").items():
        print(f"  {src:<16} {n:>2} rows: median {med:.1%}, worst {worst:.1%}")
    print(per_machine)
    for machine, (n, med, worst) in sorted(by_source(out, "machine").items()):
        print(f"  {machine}: {med:.1%} over {n} rows (worst {worst:.1%})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_published",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("data", nargs="?", help=f"dev-tables.json (default: {DATA} above the repo)")
    p.add_argument("--fit", action="store_true", help="fit the efficiency terms to these rows")
    p.add_argument("--held-out", action="store_true", help="also predict each row with terms "
                   "fitted on the other rows of its machine (about 25 s)")
    args = p.parse_args(argv)
    import json

    data = json.loads(find_data(args.data, DATA).read_text())
    rows = rows_of(data)
    fits = dict(FITS)
    if args.fit:
        for machine in sorted({r["machine"] for r in rows}):
            fits[machine] = f = fit_machine(rows, machine)
            print(f"fit {machine}: peak share {f.peak_share}, d_half {f.d_half:g}, tp_hidden "
                  f"{f.tp_hidden:g}")  # fmt: skip
    out = errors(rows, fits)
    print(table(out))
    skipped = [r["model"] for r in data["rows"] if r["source"] == "nemo_24_07"
               and r["model"] not in NEMO]  # fmt: skip
    print(f"left out (shape not published): {', '.join(skipped) or 'none'}")
    print("assumed: " + "; ".join(ASSUMED))
    _print_errors(out, "error per source (|predicted / published - 1|):",
                  "in-sample error per machine (median |error| of its rows):")  # fmt: skip
    print("  h200, b200: unknown (no published H200 or B200 rows)")
    if args.held_out:
        _print_errors(held_out(rows), "each row held out (terms fitted on its machine's other "
                      "rows):", "tie band per machine (median |error| of its rows, each held "
                      "out: the planner's):")  # fmt: skip
    print("one 22B layer (korthikanti_2022_t4, A100, TP 8), ms:")
    layer_rows = [r for r in data["rows"] if r["source"] == "korthikanti_2022_t4"]
    both = {}
    for row in layer_rows:
        f, b = layer_times(row, fits["a100"])
        both[row["setting"]] = (f + b, row["layer_forward_ms"] + row["layer_backward_ms"])
        print(f"  {row['setting']:<40} F {f:5.1f} (published {row['layer_forward_ms']:4.1f}"
              f", {f / row['layer_forward_ms'] - 1:+.0%})  backward {b:5.1f} (published "
              f"{row['layer_backward_ms']:4.1f}, {b / row['layer_backward_ms'] - 1:+.0%})")
    if "no recompute" in both:
        print("  each setting's F + backward over no recompute's (what a plan weighs them by):")
        pred0, pub0 = both["no recompute"]
        for setting, (pred, pub) in both.items():
            if setting != "no recompute":
                ratio, published = pred / pred0, pub / pub0
                print(f"    {setting:<38} {ratio:.3f} (published {published:.3f}, "
                      f"{ratio / published - 1:+.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
