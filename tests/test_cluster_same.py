"""The cluster planner answers as it did when ``tests/data/cluster_plans.json`` was written: a
few searches' JSON (every candidate row, the recommendation, the counts) hash to the same
digest. The planner's shortcuts (memoised costs, bounds and simulation set-ups) must not move
a result by a bit; a change to the model's costs on purpose rewrites the file with
``python -m bench.cluster_same --write tests/data/cluster_plans.json``."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from bench.cluster_same import CASES, differences, plans, summary

KEPT = Path(__file__).parent / "data" / "cluster_plans.json"


@pytest.fixture(scope="module")
def now():
    return plans()


def test_the_searches_give_the_plans_kept(now):
    before = json.loads(KEPT.read_text())
    assert set(before) == set(CASES)
    diffs = {name: differences(before[name], summary(plan)) for name, plan in now.items()}
    assert diffs == {name: [] for name in CASES}


def test_one_bit_off_in_one_row_is_a_difference(now):
    name = next(iter(CASES))
    moved = copy.deepcopy(now[name])
    row = moved["candidates"][-1]
    row["bubble"] = math.nextafter(row["bubble"], math.inf)
    assert [d.split(":")[0] for d in differences(summary(now[name]), summary(moved))] == ["sha256"]
