"""How still the device reference holds on a GPU, and what NVML reads there.

    python -m bench.device_reference [--launches 5] [--rounds 20] [--device 0]

For a GPU sweep, a comparison's "device differed" rests on a fixed matrix product timed with
CUDA events each round (:class:`vpipe.sweep.reference.DeviceReference`) and NVML's clocks,
temperature, power and slowdown reasons (:mod:`vpipe.trace.device_state`). This measures them
as a sweep would see them: ``--launches`` fresh processes one after the other, each timing the
device reference ``--rounds`` times (and the CPU reference of the default sweep, which on a
GPU only describes the host) with an NVML reading per round. It prints one line per launch,
the spread of the device reference within and between launches (the figure
:data:`vpipe.trace.device_state.DEVICE_LIMITS` should stay well above), and how
:func:`vpipe.trace.device_state.judge_devices` judges each launch against the next: on a
quiet GPU every pair should read "same device". Without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from typing import Any


def one_launch(rounds: int, index: int) -> dict[str, Any]:
    """One process's readings: per round the device reference, NVML's state and the CPU
    reference's time."""
    import time

    import torch

    from vpipe.sweep.driver import DEFAULT_BATCH, DEFAULT_MICROBATCHES
    from vpipe.sweep.reference import DeviceReference, Reference, device_round, reference_shape

    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    dev = DeviceReference(device)
    cpu = Reference(reference_shape({"d_model": 512, "d_hidden": 2048}, DEFAULT_BATCH,
                                    max(DEFAULT_MICROBATCHES)), torch.device("cpu"))  # fmt: skip
    for _ in range(3):  # warm-up: cuBLAS's choice, clocks up
        dev.timed()
        cpu.run()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        cpu.run()
        row = {"cpu_ref_s": time.perf_counter() - t0, **device_round(dev, device)}
        out.append(row)
    return {"name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda, "rounds": out}


def _launch(rounds: int, index: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.device_reference", "--one-launch", "--rounds",
           str(rounds), "--device", str(index)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"launch failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _log_sd(values: list[float]) -> float:
    logs = [math.log(v) for v in values if v > 0]
    return statistics.stdev(logs) if len(logs) > 1 else float("nan")


def report(launches: list[dict[str, Any]]) -> list[str]:
    """The printout's lines from each launch's readings (see the module's doc)."""
    from vpipe.trace.device_state import judge_devices, summarise

    lines = []
    summaries = []
    for i, launch in enumerate(launches):
        s = summarise(launch["rounds"])
        summaries.append(s)
        cpu = statistics.median(r["cpu_ref_s"] for r in launch["rounds"])
        nvml = (
            f"SM {s['sm_mhz']:.0f} MHz, memory {s['mem_mhz']:.0f} MHz, {s['temp_c']:.0f} C, "
            f"{s['power_w']:.0f} W, slowdown reasons: {', '.join(s['throttle']) or 'none'}"
            if s.get("sm_mhz") is not None
            else "no NVML readings (nvidia-ml-py not installed?)"
        )
        lines.append(
            f"launch {i + 1}: device reference {s['device_ref_s'] * 1e3:.3f} ms (sd "
            f"{s['device_ref_sd']:.2%} over {s['device_ref_n']} rounds), {nvml}; CPU reference "
            f"{cpu * 1e3:.2f} ms (sd {_log_sd([r['cpu_ref_s'] for r in launch['rounds']]):.1%})"
        )
    medians = [s["device_ref_s"] for s in summaries]
    cpus = [statistics.median(r["cpu_ref_s"] for r in x["rounds"]) for x in launches]
    within = statistics.median(s["device_ref_sd"] for s in summaries)
    lines.append(
        f"device reference: sd between launches {_log_sd(medians):.2%} (log), within a launch "
        f"{within:.2%} (median); CPU reference between launches {_log_sd(cpus):.1%}"
    )
    same = 0
    for i in range(len(summaries) - 1):
        words = judge_devices(summaries[i], summaries[i + 1])
        same += not words
        lines.append(f"launch {i + 1} vs {i + 2}: " + ("; ".join(words) or "same device"))
    lines.append(f"same device in {same} of {len(summaries) - 1} adjacent pairs")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=5)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: the device reference needs a GPU (nothing measured)")
        return 2
    if args.one_launch:
        print(json.dumps(one_launch(args.rounds, args.device)))
        return 0
    launches = [_launch(args.rounds, args.device) for _ in range(args.launches)]
    print(f"{launches[0]['name']}, CUDA {launches[0]['cuda']}: {args.launches} launches x "
          f"{args.rounds} rounds")  # fmt: skip
    print("\n".join(report(launches)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
