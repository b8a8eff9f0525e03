"""Predicted against published: every schedule's speedup over 1F1B in the zero-bubble paper's
tables, from the costs it profiled.

Reads the paper's Tables 3, 9, 12 and 6 (``dev-tables.json``, described in the README beside
it): Table 3's models, Table 9's profiled per-pass times T_F, T_B (input gradient), T_W and
T_comm, and the throughput measured in Tables 12 and 6. Only Table 3 and Table 9 go in; the
measured throughputs are read to be compared with, never used. For each model the profiled
times give the achieved FLOP/s of F, I and W on its profiled stage (:mod:`vpipe.sim.arch`
counts the FLOPs) and T_comm the link's bandwidth; :mod:`vpipe.sim.model_costs` then costs
every stage of every measured setup (its pipeline size, microbatch size, layers per stage with
the embedding and the head), the simulator runs each schedule, and :mod:`vpipe.sim.iteration`
adds the iteration's end: the optimizer step (memory-bound), the tied embedding's gradient
all-reduce between the first and last stage, and the global synchronisation before the
step, which the paper's ZB schedules replace with post-validation.

Schedules: 1F1B as ``1f1b``, 1F1B-I as ``interleaved-1f1b`` with one layer per virtual stage
(the paper's runs), ZB-1p and ZB-2p as ``auto`` on the loop placement at memory limits of P
and 2P full stages (the memory model in which the input gradient frees its share, from the
model's own accounting), ZB-V as ``zbv``. Not printed in the paper and so assumed here: the
vocabulary (GPT-3's 50257, padded to 50304 as Megatron does), fp16 (the authors' scripts),
no flash attention, dropout, learned positions, tied embeddings.

Run: ``python -m bench.published [PATH]`` (default: ``shared/data/zero-bubble-paper`` in a
folder above the repository); ``--terms`` also prints what each modelled term changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vpipe.sim.activation_memory import activation_peaks
from vpipe.sim.arch import Arch
from vpipe.sim.machine import PRESETS
from vpipe.sim.model_costs import (
    Layout,
    ModelCosts,
    Rates,
    layer_split,
    model_costs,
)

DATA = Path("shared") / "data" / "zero-bubble-paper" / "dev-tables.json"
VOCAB = 50304  # GPT-3's 50257 padded to a multiple of 128 (Megatron's default)
SCHEDULES = {"1F1B": "1f1b", "1F1B-I": "interleaved-1f1b", "ZB-1p": "auto", "ZB-2p": "auto",
             "ZB-2p*": "auto", "ZB-V": "zbv"}  # fmt: skip
LIMITS = {"ZB-1p": 1, "ZB-2p": 2, "ZB-2p*": 2}  # memory limit in P full stages
POST_VALIDATED = {"ZB-1p", "ZB-2p", "ZB-2p*", "ZB-V"}  # the paper's optimizer for its schedules


@dataclass(frozen=True)
class Terms:
    """Which modelled terms are on (``--terms`` switches each off in turn)."""

    iteration_end: bool = True  # optimizer step, tied-embedding all-reduce, synchronisation
    stage_split: bool = True  # layers per stage with the embedding and head (else uniform)
    i_frees: bool = True  # I frees its share of the activations (else held until W)


def find_data(given: str | None, data: Path = DATA) -> Path:
    """``given``, else ``data`` (``shared/data/...``) in the first folder above the repository
    that has it."""
    if given:
        return Path(given)
    root = Path(__file__).resolve().parents[1]
    for folder in root.parents:
        if (folder / data).is_file():
            return folder / data
    raise SystemExit(f"no {data} above {root}; pass its path")


def load(path: Path) -> dict[str, Any]:
    """Table 3's models, Table 9's median profiled times per model, and the measured rows."""
    entries = json.loads(path.read_text())["entries"]
    models: dict[str, dict[str, Any]] = {}
    profiled: dict[str, dict[str, list[float]]] = {}
    setups: dict[str, dict[str, Any]] = {}
    measured = []
    for e in entries:
        table = e["table"].split(" (")[0]
        if table == "Table 3":
            models.setdefault(e["model"], {})[e["metric"]] = e["value"]
        elif table == "Table 9":
            profiled.setdefault(e["model"], {}).setdefault(e["metric"], []).append(e["value"])
            setups[e["model"]] = e["setup"]
        elif e["kind"] == "measured":
            measured.append({**e, "table": table})
    medians = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in profiled.items()}
    return {"models": models, "profiled": medians, "profile_setups": setups, "rows": measured}


def arch_of(model: str, table3: dict[str, Any], microbatch: int) -> Arch:
    return Arch(
        model, layers=table3["layers"], hidden=table3["hidden_size"],
        heads=table3["attention_heads"], seq_len=table3["seq_len"], vocab=VOCAB,
        microbatch=microbatch, precision="fp16", dropout=True, flash_attention=False,
        learned_positions=True, tied_embeddings=True,
    )  # fmt: skip


def profiled_costs(data: dict[str, Any], model: str) -> tuple[Rates, float]:
    """The achieved F, I, W rates on the profiled stage (the median one, as the paper's
    scheduler takes the median across stages) and the link's bytes per second."""
    setup, times = data["profile_setups"][model], data["profiled"][model]
    arch = arch_of(model, data["models"][model], setup["microbatch_size"])
    layers = layer_split(arch.layers, setup["pp_stages"])
    flops = sorted((k * arch.layer_flops("F") + (arch.head_flops("F") if s == len(layers) - 1
                    else 0), s) for s, k in enumerate(layers))  # fmt: skip
    stage = flops[len(flops) // 2][1]
    head = stage == len(layers) - 1
    ms = [times["T_F"], times["T_B"], times["T_W"]]
    rates = Rates.measured(arch, layers[stage], head, [t / 1e3 for t in ms],
                           f"Table 9 ({model}, median over its m)")  # fmt: skip
    return rates, arch.boundary_bytes() / (times["T_comm"] / 1e3)


def machine_with_link(bandwidth: float) -> Any:
    """The A100 preset with every pipeline message at the profiled link's bandwidth."""
    return replace(PRESETS["a100"], intra_node_bandwidth=bandwidth,
                   inter_node_bandwidth=bandwidth, intra_node_latency=0.0,
                   inter_node_latency=0.0)  # fmt: skip


def costs_for(data, model: str, schedule: str, gpus: int, microbatch: int, terms: Terms):
    rates, bandwidth = profiled_costs(data, model)
    arch = arch_of(model, data["models"][model], microbatch)
    v = 1
    if schedule == "ZB-V":
        v = 2
    elif schedule == "1F1B-I":
        v = max(1, -(-arch.layers // gpus))
    layout = Layout(gpus, 1, v, "v" if schedule == "ZB-V" else "loop", shard="none")
    costs = model_costs(arch, machine_with_link(bandwidth), layout, rates)
    if not terms.stage_split:  # every stage its share of the layers, no embedding or head
        costs = _uniform(costs)
    return costs


def _uniform(c: ModelCosts) -> ModelCosts:
    n = len(c.f)
    share = c.arch.layers / n
    return replace(
        c, f=[share * c.arch.layer_flops("F") / c.rates.f] * n,
        i=[share * c.arch.layer_flops("I") / c.rates.i] * n,
        w=[share * c.arch.layer_flops("W") / c.rates.w] * n,
        saved_bytes=[share * c.arch.layer_saved_bytes()] * n,
        held_after_i=[share * c.arch.layer_weight_grad_bytes()] * n,
    )  # fmt: skip


def iteration_s(costs: ModelCosts, schedule: str, m: int, terms: Terms) -> tuple[float, float]:
    """(iteration seconds, peak GB on the fullest GPU) of ``schedule`` with ``m`` microbatches."""
    from vpipe.schedules import make_schedule
    from vpipe.schedules.adaptive import MemoryModel
    from vpipe.schedules.auto import auto_schedule
    from vpipe.sim import simulate
    from vpipe.sim.iteration import IterationCosts, iteration

    pp = costs.layout.pp
    cm = costs.cost_model()
    alloc = costs.alloc_bytes
    freed = costs.freed_by_i if terms.i_frees else [0.0] * len(alloc)
    post = schedule in POST_VALIDATED
    if schedule in LIMITS:
        limit = LIMITS[schedule] * pp * max(alloc[:2])
        built = auto_schedule(pp, m, cm, limit, "loop", objective="span" if post else "makespan",
                              memory=MemoryModel.from_bytes(alloc, freed))  # fmt: skip
    else:
        built = make_schedule(SCHEDULES[schedule], pp, m, costs.layout.stages_per_rank)
    sim = simulate(built, cm)
    end = costs.iteration_costs(post) if terms.iteration_end else IterationCosts([0.0] * pp, (),
                                                                                 0.0, post)
    it = iteration(sim.columns, pp, end)
    peaks = activation_peaks(built, alloc, freed)
    memory = max(s + t + p for s, t, p in zip(costs.static_bytes, costs.transient_bytes, peaks,
                                              strict=True))  # fmt: skip
    return it.time / 1e6, memory / 1e9


def predictions(data: dict[str, Any], terms: Terms = Terms()) -> list[dict[str, Any]]:
    """Every measured throughput row with its prediction, and each non-1F1B row's speedup over
    the 1F1B row of the same table, model and global batch, predicted and measured."""
    rows = [r for r in data["rows"] if r["metric"] == "throughput"]
    memory = {(r["table"], r["model"], r["schedule"], r["m"]): r["value"]
              for r in data["rows"] if r["metric"] == "peak_memory"}  # fmt: skip
    out = []
    for r in rows:
        st = r["setup"]
        gpus, mb, m = st["gpus"], st["microbatch_size"], r["m"]
        costs = costs_for(data, r["model"], r["schedule"], gpus, mb, terms)
        seconds, peak_gb = iteration_s(costs, r["schedule"], m, terms)
        samples = m * mb
        out.append({
            "table": r["table"], "model": r["model"], "schedule": r["schedule"], "m": m,
            "microbatch": mb, "gpus": gpus, "batch": samples,
            "predicted": samples / seconds / gpus, "measured": r["value"],
            "peak_gb": peak_gb,
            "measured_gb": memory.get((r["table"], r["model"], r["schedule"], m)),
        })  # fmt: skip
    for row in out:
        base = [b for b in out if b["schedule"] == "1F1B" and b["table"] == row["table"]
                and b["model"] == row["model"] and b["batch"] == row["batch"]
                and b["gpus"] == row["gpus"]]  # fmt: skip
        if row["schedule"] != "1F1B" and base:
            row["speedup_predicted"] = row["predicted"] / base[0]["predicted"]
            row["speedup_measured"] = row["measured"] / base[0]["measured"]
            row["error"] = row["speedup_predicted"] / row["speedup_measured"] - 1
    return out


def summary(out: Sequence[dict[str, Any]]) -> dict[str, float]:
    errors = [abs(r["error"]) for r in out if "error" in r]
    return {
        "speedups": len(errors),
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "within_3pct": sum(e <= 0.03 for e in errors),
    }


def report(out: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'table':<9}{'model':<7}{'schedule':<9}{'m':>4}{'speedup pred':>14}"
             f"{'measured':>10}{'error':>8}   {'samples/GPU/s pred':>19}{'meas':>7}"
             f"{'err':>8}   {'GB pred':>8}{'meas':>6}"]  # fmt: skip
    for r in sorted(out, key=lambda r: (r["table"], r["model"], r["schedule"], r["m"])):
        speed = (f"{r['speedup_predicted']:>14.3f}{r['speedup_measured']:>10.3f}"
                 f"{r['error']:>+8.1%}" if "error" in r else " " * 32)  # fmt: skip
        mem = f"{r['peak_gb']:>8.1f}{r['measured_gb'] or float('nan'):>6.0f}"
        lines.append(
            f"{r['table']:<9}{r['model']:<7}{r['schedule']:<9}{r['m']:>4}{speed}   "
            f"{r['predicted']:>19.2f}{r['measured']:>7.2f}"
            f"{r['predicted'] / r['measured'] - 1:>+8.1%}   {mem}"
        )
    s = summary(out)
    lines.append(
        f"{s['speedups']} speedups over 1F1B: median |error| {s['median_abs_error']:.1%}, "
        f"largest {s['max_abs_error']:.1%}, {s['within_3pct']} within 3%"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.published", description=__doc__.split("\n")[0])
    p.add_argument("data", nargs="?", help=f"dev-tables.json (default: {DATA} above the repo)")
    p.add_argument("--terms", action="store_true", help="also switch each modelled term off")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    data = load(find_data(args.data))
    out = predictions(data)
    if args.json:
        print(json.dumps({"rows": out, "summary": summary(out)}))
        return 0
    for model in sorted(data["profiled"]):
        rates, bandwidth = profiled_costs(data, model)
        eff = rates.efficiency(PRESETS["a100"], "fp16")
        print(f"{model}: F {eff['F']:.2f}, I {eff['I']:.2f}, W {eff['W']:.2f} of the A100's "
              f"fp16 peak; link {bandwidth / 1e9:.1f} GB/s (from Table 9)")  # fmt: skip
    print(report(out))
    if args.terms:
        for name in ("iteration_end", "stage_split", "i_frees"):
            s = summary(predictions(data, replace(Terms(), **{name: False})))
            print(f"without {name}: median |error| {s['median_abs_error']:.1%}, largest "
                  f"{s['max_abs_error']:.1%}, {s['within_3pct']} of {s['speedups']} within 3%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
