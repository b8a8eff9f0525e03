"""How often ``vpipe bench``'s verdict names a winner that is not there, and finds one that
is, when rounds are added until the order is decided (:mod:`vpipe.report.winner`).

    python -m bench.verdict_rules [--trials 200] [--noise 0.10] [--max-rounds 30]
        [--timing-precision PCT]

Synthetic sweeps of three schedules (3 timed steps per round, 3 base rounds, then rounds of
the open configs only, as :mod:`vpipe.sweep.rounds` adds them, up to ``--max-rounds``: the
time budget; with ``--timing-precision``, also of the configs whose median is not yet known
to +-PCT%, as ``vpipe bench`` adds them). Each step is its schedule's time x a factor shared by the round's steps (the
host of that moment) x its own lognormal noise (``--noise``, log sd); one step in 50 is a
hiccup 4x as long. Cases:

- **A/A/A**: three schedules of equal speed: any "run X" that is not a tie is a false winner;
- **5% apart**: one schedule 5% faster than two equal ones: how often the verdict names it;
- **1% apart**: a difference inside the 2% tie band: how often it is (rightly) a tie.

Checking after every round (optional stopping) raises the chance of a false winner above the
5% of one fixed-size interval; this measures by how much.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from vpipe.report.winner import open_configs, standings
from vpipe.stats import looser_than

SCHEDULES = ("1f1b", "zb-h1", "zbv")


def sweep(speeds: dict[str, float], noise: float, max_rounds: int, rng: np.random.Generator,
          precision: float = 0.0):  # fmt: skip
    """The steps of one adaptive sweep, and how many rounds it ran."""
    rows: list[dict] = []

    def run(r: int, active: list[str]) -> None:
        host = np.exp(noise * rng.standard_normal())
        for k in range(3):
            for s in active:
                t = speeds[s] * host * np.exp(noise * rng.standard_normal())
                t *= 4 if rng.random() < 0.02 else 1
                rows.append(dict(schedule=s, microbatches=8, impl="vpipe", round=r, step=k,
                                 step_time_s=t))  # fmt: skip

    for r in range(3):
        run(r, list(speeds))
    r = 3
    while r < max_rounds and (active := _active(pd.DataFrame(rows), speeds, precision)):
        run(r, active)
        r += 1
    return pd.DataFrame(rows), r


def _active(steps: pd.DataFrame, speeds: dict[str, float], precision: float) -> list[str]:
    """The schedules of the next round: open ones, and those whose median is not yet known to
    +-``precision`` percent (none when 0)."""
    wanted = open_configs(steps)
    times = {s: g["step_time_s"] for s, g in steps.groupby("schedule")}
    loose = set(looser_than(times, precision)) if precision else set()
    return [s for s in speeds if (s, 8, "vpipe") in wanted or s in loose]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--noise", type=float, default=0.10, help="log sd of one step (default 0.10)")
    ap.add_argument("--max-rounds", type=int, default=30, help="the budget, in rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing-precision", type=float, default=0.0, metavar="PCT",
                    help="also add rounds to configs whose median is looser than +-PCT%% "
                    "(vpipe bench's default: 3; default here 0)")  # fmt: skip
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    cases = {
        "A/A/A": {s: 0.2 for s in SCHEDULES},
        "5% apart": {"1f1b": 0.21, "zb-h1": 0.21, "zbv": 0.2},
        "1% apart": {"1f1b": 0.202, "zb-h1": 0.202, "zbv": 0.2},
    }
    print(f"{args.trials} trials per case, step noise {args.noise:g} (log sd), rounds 3 to "
          f"{args.max_rounds}, timing precision {args.timing_precision:g}%")  # fmt: skip
    for name, speeds in cases.items():
        winners, ties, fastest_named, rounds = 0, 0, 0, []
        for _ in range(args.trials):
            steps, n = sweep(speeds, args.noise, args.max_rounds, rng, args.timing_precision)
            (st,) = standings(steps)
            rounds.append(n)
            if len(st.contenders) == 1:
                winners += 1
                fastest_named += st.leader == "zbv"
            else:
                ties += 1
        print(
            f"{name:>9}: a winner in {winners}/{args.trials} ({fastest_named} of them the truly "
            f"fastest, zbv where one is), a tie in {ties}; rounds median "
            f"{int(np.median(rounds))}, {sum(n >= args.max_rounds for n in rounds)} ran out of "
            "budget"
        )


if __name__ == "__main__":
    main()
