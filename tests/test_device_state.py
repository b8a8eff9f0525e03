"""The device reference and NVML state of GPU sweeps, exercised with stand-ins (no GPU here):
NVML's readings through a stand-in module, the judgement of two runs' devices, a GPU
comparison that rests on the device and not on the CPU, and the lead's check's printout."""

from __future__ import annotations

import types

import numpy as np
import pandas as pd
import pytest

from vpipe.trace.device_state import (
    DEVICE_LIMITS,
    judge_devices,
    reference_limit,
    sample,
    summarise,
    throttle_reasons,
)


def fake_nvml(sm=1980, mem=2619, temp=41, power_mw=320_000, reasons=0, broken=()):
    """A stand-in for pynvml with the functions vpipe reads."""

    def fn(name, value):
        def call(handle, *args):
            assert handle == "gpu0"
            if name in broken:
                raise RuntimeError("NVMLError_NotSupported")
            return value

        return call

    return types.SimpleNamespace(
        NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
        nvmlDeviceGetClockInfo=lambda h, kind: {1: sm, 2: mem}[kind],
        nvmlDeviceGetTemperature=fn("temp", temp),
        nvmlDeviceGetPowerUsage=fn("power", power_mw),
        nvmlDeviceGetCurrentClocksEventReasons=fn("reasons", reasons),
    )  # fmt: skip


def test_nvml_readings_through_a_stand_in():
    s = sample(0, fake_nvml(reasons=0x4 | 0x1))
    assert s == {"sm_mhz": 1980, "mem_mhz": 2619, "temp_c": 41, "power_w": 320.0, "throttle": 5}
    assert sample(0, fake_nvml(broken=("power",)))["power_w"] is None
    assert throttle_reasons(0x4 | 0x1 | 0x40) == ["SW power cap", "HW thermal slowdown"]
    assert throttle_reasons(None) == [] and throttle_reasons(0x1) == []  # idle is no slowdown


def _rounds(ref_ms=8.9, sd=0.001, n=12, seed=0, **nvml):
    rng = np.random.default_rng(seed)
    state = sample(0, fake_nvml(**nvml))
    return [
        {"device_ref_s": ref_ms / 1e3 * float(np.exp(sd * rng.standard_normal())), **state,
         "other_cores": 0.0, "load1": 0.1}
        for _ in range(n)
    ]  # fmt: skip


def test_a_quiet_gpu_judged_against_itself_is_the_same_device():
    a, b = summarise(_rounds(seed=1)), summarise(_rounds(seed=2))
    assert a["device_ref_n"] == 12 and 0.0005 < a["device_ref_sd"] < 0.002
    assert judge_devices(a, b) == []
    assert summarise([{"other_cores": 0.1}]) == {}  # a CPU sweep's rounds: no device state


def test_what_makes_a_device_differ():
    base = summarise(_rounds())
    assert judge_devices(base, summarise(_rounds(sm=1755))) == ["SM clock 1980 vs 1755 MHz"]
    hot = judge_devices(base, summarise(_rounds(temp=83, reasons=0x20)))
    assert hot == [
        "GPU temperature 41 vs 83 C",
        "slowdown reasons none vs SW thermal slowdown",
    ]
    slow = judge_devices(base, summarise(_rounds(ref_ms=9.5)))
    assert len(slow) == 1 and slow[0].startswith("device reference 8.9")
    # a reference that spreads more within its runs earns a wider limit before it counts
    noisy = summarise(_rounds(sd=0.05, seed=3)), summarise(_rounds(sd=0.05, seed=4, ref_ms=9.2))
    assert reference_limit(*noisy, DEVICE_LIMITS["device_ref_floor"], 3.0) > 0.05
    assert judge_devices(*noisy) == []


def _gpu_sweep(label, rounds, step_ms):
    from vpipe.report.comparison import Sweep

    runs = pd.DataFrame(
        [{"schedule": "zbv", "microbatches": 8, "impl": "vpipe", "step_time_s": step_ms / 1e3,
          "host": "h200", "torch": "2.9", "threads": 8, "device": "cuda", "backend": "nccl",
          "ranks": 1, "model": "gpt", "sizes": "{}", "batch": 32, "commit": label}]
    )  # fmt: skip
    rng = np.random.default_rng(len(label))
    steps = pd.DataFrame(
        [{"schedule": "zbv", "microbatches": 8, "impl": "vpipe", "block": 0, "round": i,
          "step": 0, "step_time_s": step_ms / 1e3 * (1 + 0.001 * rng.standard_normal()),
          "ref_s": 0.012 * (1.15 if label == "b" else 1.0)} for i in range(4)]
    )  # fmt: skip
    host = pd.DataFrame(rounds)
    return Sweep(label, runs, steps, host, {"rounds": 4})


def test_a_gpu_comparison_rests_on_the_device_not_the_cpu():
    from vpipe.report.comparison import comparison_table

    busy_cpu = [{**r, "other_cores": 1.2} for r in _rounds(seed=5)]  # the host side differed
    table = comparison_table([_gpu_sweep("a", _rounds(seed=6), 30.0), _gpu_sweep("b", busy_cpu, 30.0)])
    row = table.iloc[0]
    # four steps spread 0.1% give an interval (no "too few steps"), and the busy CPU does not
    # count: the CPU's reference was 15% slower in b and other processes used 1.2 cores
    assert row["95% CI"] and row["verdict"] in ("within noise", "inconclusive")
    assert row["host"] == "" and row["figure"] == "raw" and row["steps"] == "4+4"
    throttled = _rounds(seed=7, sm=1600, reasons=0x40)
    table = comparison_table([_gpu_sweep("a", _rounds(seed=6), 30.0), _gpu_sweep("b", throttled, 33.0)])
    row = table.iloc[0]
    assert row["verdict"] == "device differed" and "SM clock" in row["host"]
    assert "vpipe ab a b" in row["to settle"]


def test_the_lead_check_prints_one_line_per_launch_and_judges_neighbours():
    from bench.device_reference import report

    launches = [
        {"name": "stand-in", "cuda": "12", "rounds": [{**r, "cpu_ref_s": 0.012} for r in _rounds(seed=s)]}
        for s in range(3)
    ]  # fmt: skip
    lines = report(launches)
    assert lines[0].startswith("launch 1: device reference 8.9") and "SM 1980 MHz" in lines[0]
    assert lines[3].startswith("device reference: sd between launches")
    assert lines[-1] == "same device in 2 of 2 adjacent pairs"


@pytest.mark.parametrize("have", [True, False])
def test_device_round_is_empty_on_a_cpu(have, monkeypatch):
    from vpipe.sweep import reference

    if have:
        monkeypatch.setattr("vpipe.trace.device_state.nvml", lambda: fake_nvml())
        monkeypatch.setattr(reference, "nvml_index", lambda device: 0)
        stand_in = types.SimpleNamespace(timed=lambda: 0.009)
        row = reference.device_round(stand_in, None)
        assert row["device_ref_s"] == 0.009 and row["sm_mhz"] == 1980
    else:
        assert reference.device_round(None, None) == {}
