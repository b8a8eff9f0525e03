"""The one-line verdicts: a single sweep's winner (within-run, paired), and merging blocks."""

from __future__ import annotations

import numpy as np
import pandas as pd

from vpipe.report.winner import winner_line
from vpipe.sweep.blocks import merge_blocks


def _steps(times: dict[str, float], noise: float, rounds: int = 3, steps: int = 3):
    rng = np.random.default_rng(0)
    rows = []
    for r in range(rounds):
        for k in range(steps):
            host = 1 + noise * rng.standard_normal()  # shared by the round's pair
            for sched, t in times.items():
                jitter = 1 + noise * rng.standard_normal()
                rows.append(dict(schedule=sched, microbatches=4, impl="vpipe", round=r, step=k,
                                 step_time_s=t * host * jitter))  # fmt: skip
    return pd.DataFrame(rows)


def test_winner_line_names_the_winner_with_its_interval():
    line = winner_line(_steps({"1f1b": 0.10, "zbv": 0.08}, noise=0.01), rounds=3)
    assert line.startswith("winner (M=4 vpipe): zbv, 1.2")
    assert "faster than 1f1b (95% CI 1." in line


def test_winner_line_says_no_winner_and_the_rounds_to_settle():
    line = winner_line(_steps({"1f1b": 0.100, "zbv": 0.099}, noise=0.08), rounds=3)
    assert line.startswith("no winner at this noise (M=4 vpipe):")
    assert "rounds would settle it (--rounds" in line
    assert winner_line(_steps({"zbv": 0.1}, noise=0.0), 3) == (
        "one schedule per group: nothing to rank"
    )


def test_merge_blocks_appends_every_blocks_steps_and_marks_host_rounds():
    def rank(r, t):
        return {"rank": r, "times": [[t, t], [2 * t, 2 * t]], "refs": [[1, 1], [1, 1]],
                "host_rounds": [{"load1": t}], "memory": {}}  # fmt: skip

    merged = merge_blocks([[rank(1, 0.1), rank(0, 0.1)], [rank(0, 0.3), rank(1, 0.3)]])
    assert [m["rank"] for m in merged] == [0, 1]
    assert merged[0]["times"] == [[0.1, 0.1, 0.3, 0.3], [0.2, 0.2, 0.6, 0.6]]
    assert merged[0]["refs"] == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert merged[0]["host_rounds"] == [{"load1": 0.1, "block": 0}, {"load1": 0.3, "block": 1}]
