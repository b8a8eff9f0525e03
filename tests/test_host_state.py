"""Host state from made-up /proc contents, and the judgement of two runs' hosts."""

from __future__ import annotations

import pytest

from vpipe.trace import host_state
from vpipe.trace.host_state import (
    judge_hosts,
    parse_cpu_mhz,
    parse_loadavg,
    parse_proc_stat,
    round_state,
    summarise,
)

STAT = """cpu  100 0 50 800 10 0 5 20 0 0
cpu0 50 0 25 400 5 0 2 10 0 0
cpu1 50 0 25 400 5 0 3 10 0 0
intr 123
"""


def test_parsers_read_proc_text():
    assert parse_loadavg("1.50 0.80 0.40 2/300 999\n") == 1.5
    j = parse_proc_stat(STAT)
    assert j == {"busy": 155, "steal": 20, "total": 985, "cores": 2}
    assert parse_cpu_mhz("cpu MHz\t\t: 2000.0\nfoo: 1\ncpu MHz : 3000.0\n") == 2500.0
    assert parse_cpu_mhz("model name: x\n") is None
    with pytest.raises(ValueError, match="no aggregate"):
        parse_proc_stat("intr 1\n")


def _sample(wall, busy, steal, total, load=1.0, mhz=2000.0):
    return {"wall_s": wall, "own_cpu_s": 0.0, "load1": load, "busy_j": busy, "steal_j": steal,
            "total_j": total, "cores": 2, "mhz": mhz}  # fmt: skip


def test_round_state_subtracts_the_sweeps_own_cpu(monkeypatch):
    monkeypatch.setattr(host_state, "CLOCK_TICKS", 100)
    # 2 s of wall on 2 cores: 400 jiffies in all, 300 busy (3 CPU seconds), 40 stolen;
    # the sweep's ranks used 2 CPU seconds: others kept 0.5 cores busy
    before = _sample(10.0, 1000, 100, 5000, load=1.0)
    after = _sample(12.0, 1300, 140, 5400, load=2.0, mhz=2200.0)
    s = round_state(before, after, own_cpu_s=2.0)
    assert s["other_cores"] == pytest.approx(0.5) and s["free_cores"] == pytest.approx(1.5)
    assert s["steal"] == pytest.approx(0.1)
    assert s["load1"] == 1.5 and s["mhz"] == 2100.0
    # unreadable /proc: the figures are None, not an error
    bare = {**before, "busy_j": None}
    assert round_state(bare, after, 2.0)["other_cores"] is None


def test_judge_hosts_names_what_differed_with_figures():
    quiet = summarise(
        [{"other_cores": 0.05, "steal": 0.0, "load1": 2.0, "mhz": 2600, "ref_s": 1e-3}] * 3
    )
    busy = {**quiet, "other_cores": 1.0, "load1": 3.0}
    assert judge_hosts(quiet, quiet) == []
    assert judge_hosts(quiet, busy) == ["other processes' CPU 0.05 vs 1.00 cores"]
    # a saturated host: the extra job barely shows in other processes' CPU (0.41 cores more),
    # but it halves what is left to the sweep
    loaded = {**quiet, "other_cores": 1.08, "free_cores": 0.92}
    hogged = {**quiet, "other_cores": 1.49, "free_cores": 0.51}
    assert judge_hosts(loaded, hogged) == ["cores left to the sweep 0.92 vs 0.51"]
    alike = {**quiet, "other_cores": 1.0, "free_cores": 1.0}
    assert judge_hosts(loaded, alike) == []
    slow_ref = {**quiet, "ref_s": 1.5e-3, "mhz": 2000}
    words = judge_hosts(quiet, slow_ref)
    assert words == ["CPU MHz 2600 vs 2000", "reference time 0.001 s vs 0.0015 s (limit 17%)"]
    # quiet runs' references may be REF_Z x sqrt 2 x REF_RUN_SD apart (17%, over the 10% floor)
    assert judge_hosts(quiet, {**quiet, "ref_s": 1.15e-3}) == []
    # a run whose blocks spread more widens the limit for it
    spread = summarise(
        [{"block": b, "ref_s": r, "other_cores": 0.05} for b, r in enumerate((1e-3, 1.2e-3, 0.9e-3))]
    )
    assert spread["ref_spread"] == pytest.approx(0.144, abs=0.002)
    assert judge_hosts(quiet, {**spread, "ref_s": 1.3e-3}) == []
    assert judge_hosts(quiet, {**quiet, "ref_s": 1.3e-3}) != []
    # nothing recorded (an older store): nothing to judge
    assert judge_hosts(summarise([]), busy) == []
    assert summarise([{"other_cores": None}, {"other_cores": 0.2}])["other_cores"] == 0.2
