"""Tests of the schedule generators (vpipe.schedules): validity for every family over P in 1..8
and several M, lowering, rejection messages, and simulated bubbles and memory against the
closed forms (zero communication cost throughout).

Bubble definitions (vpipe.sim.simulator's): a rank's *whole-step* bubble is the makespan minus its busy
time; its *skew-excluding* bubble is its idle time between its own first and last action.
The GPipe, 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV closed forms are whole-step figures;
ZB-V's "zero bubble" is the skew-excluding one (its whole step keeps a (P-1)f start-up skew).
"""

from __future__ import annotations

import pytest

from vpipe.errors import ScheduleError
from vpipe.ir import Kind, Schedule, v_placement
from vpipe.ir.lowering import lower, validate
from vpipe.schedules import make_schedule, schedule_names
from vpipe.schedules.interleaved import rounds
from vpipe.sim import CostModel, simulate

NAMES = [
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "looped-bfs",
    "zb-h1",
    "zb-h2",
    "zbv",
    "v-half",
    "v-min",
    "dualpipev",
    "auto",
]
LOOP_V = ("interleaved-1f1b", "looped-bfs", "zb-h1")  # families with a stages-per-rank choice
V_FAMILIES = ("zbv", "v-half", "v-min", "dualpipev", "auto")
SPLIT = ("zb-h1", "zb-h2", "zbv", "v-half", "v-min", "auto")  # I/W split, never a full B
RANKS = list(range(1, 9))


def _micro(p: int) -> list[int]:
    """M = 1, M < P (where P > 2), M = P, M = 2P, odd M (3 and 2P+1)."""
    return sorted({1, 3, max(1, p - 1), p, 2 * p, 2 * p + 1})


def _variants(name: str) -> list[int | None]:
    """Default and 3 stages per rank (v = 1 of these families is 1F1B or GPipe, see below)."""
    return [None, 3] if name in LOOP_V else [None]


def _sim(s: Schedule, f: float = 1, b: float = 1, w: float = 1):
    return simulate(s, CostModel.parse(f"f={f},b={b},w={w},comm=0,unit=stage"))


def _idle(res) -> list[float]:
    """Whole-step idle time per rank."""
    return [r * res.makespan for r in res.bubble_ratio_per_rank]


def _check_structure(s: Schedule) -> None:
    """Each (stage, microbatch) has one F and then one B, or one I and later one W, all on the
    rank that owns the stage, in that program order."""
    seen: dict[tuple[int, int], list[tuple[Kind, int]]] = {}
    for r, i, a in s.iter_actions():
        assert a.is_compute, f"rank {r} position {i}: {a} in a compute-only schedule"
        for part in a.compute_parts():
            assert s.placement[part.stage] == r, f"{part} runs on rank {r}"
            seen.setdefault((part.stage, part.microbatch), []).append((part.kind, i))
    expected = {(st, m) for st in range(s.n_stages) for m in range(s.n_microbatches)}
    assert set(seen) == expected
    for key, items in seen.items():
        kinds = [k for k, _ in items]
        assert kinds in ([Kind.F, Kind.B], [Kind.F, Kind.I, Kind.W]), (key, kinds)
        positions = [i for _, i in items]
        assert positions == sorted(set(positions)), (key, positions)


def _check_comm(s: Schedule, low: Schedule) -> None:
    """Comm only on cross-rank edges, and all of them: 4 actions (SEND/RECV of F and of B)
    per cross-rank adjacent pair and microbatch."""
    pl = s.placement
    peer = {
        Kind.SEND_F: lambda st: st + 1,
        Kind.RECV_F: lambda st: st - 1,
        Kind.SEND_B: lambda st: st - 1,
        Kind.RECV_B: lambda st: st + 1,
    }
    n_comm = 0
    for r, i, a in low.iter_actions():
        if a.is_comm:
            n_comm += 1
            assert pl[a.stage] == r and pl[peer[a.kind](a.stage)] != r, (
                f"rank {r} position {i}: {a} between stages on one rank"
            )
    crossing = sum(pl[st] != pl[st + 1] for st in range(s.n_stages - 1))
    assert n_comm == 4 * s.n_microbatches * crossing
    assert low.compute_only().actions == s.actions


# ---------------------------------------------------------------------------------------------
# Registry and rejections


def test_registry_names_and_descriptions():
    names = schedule_names()
    assert list(names) == NAMES
    for name, desc in names.items():
        assert desc and "\n" not in desc, name


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("nope", 2, 2), "unknown schedule 'nope': choose one of gpipe, 1f1b"),
        (("zbv", 4, 8, 3), "zbv needs exactly 2 stages per rank (V placement"),
        (("zbv", 4, 8, 3), "got 3"),
        (("dualpipev", 2, 8, 1), "dualpipev needs exactly 2 stages per rank"),
        (("gpipe", 2, 4, 2), "use looped-bfs or interleaved-1f1b for several stages per rank"),
        (("1f1b", 2, 4, 3), "1f1b needs exactly 1 stage per rank"),
        (("interleaved-1f1b", 2, 4, 0), "stages per rank must be at least 1, got 0"),
        (("zb-h1", 2, 4, 2.0), "stages per rank must be an integer"),
        (("1f1b", 0, 4), "ranks must be at least 1, got 0"),
        (("zbv", 2, 0), "microbatches must be at least 1, got 0"),
        (("gpipe", "4", 4), "ranks must be an integer, got '4'"),
        (("gpipe", True, 4), "ranks must be an integer"),
    ],
)
def test_rejections_say_what_would_work(args, needle):
    with pytest.raises(ScheduleError) as e:
        make_schedule(*args)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_integer_like_counts_are_accepted():
    np = pytest.importorskip("numpy")
    s = make_schedule("zb-h1", np.int64(3), np.int32(4), np.int64(2))
    assert (s.n_ranks, s.n_microbatches, s.n_stages) == (3, 4, 6)
    assert all(type(x) is int for x in (s.n_ranks, s.n_microbatches, s.n_stages))


def test_interleaved_rounds_cover_microbatches_with_at_least_p_each():
    for p in RANKS:
        for m in range(1, 4 * p + 2):
            rs = rounds(p, m)
            assert [i for r in rs for i in r] == list(range(m)), (p, m)
            sizes = [len(r) for r in rs]
            assert max(sizes) - min(sizes) <= 1, (p, m)
            assert min(sizes) >= p or sizes == [m], (p, m)


def test_degenerate_stages_per_rank_match_the_simple_families():
    """v = 1 interleaved 1F1B is 1F1B and v = 1 looped BFS is GPipe, action for action."""
    for p in (1, 3, 5):
        for m in (1, p, 2 * p + 1):
            one = make_schedule("1f1b", p, m).actions
            assert make_schedule("interleaved-1f1b", p, m, 1).actions == one
            assert (
                make_schedule("looped-bfs", p, m, 1).actions == make_schedule("gpipe", p, m).actions
            )


# ---------------------------------------------------------------------------------------------
# Validity for every family, P in 1..8, several M


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_is_valid_and_lowers(name):
    for p in RANKS:
        for m in _micro(p):
            for v in _variants(name):
                s = make_schedule(name, p, m, v)
                where = f"{name} P={p} M={m} v={v}"
                assert (s.name, s.n_ranks, s.n_microbatches) == (name, p, m), where
                if name in V_FAMILIES:
                    assert s.placement == v_placement(p) and s.loss_rank == 0, where
                else:
                    spr = v or (2 if name in ("interleaved-1f1b", "looped-bfs") else 1)
                    assert (s.n_stages, s.style) == (p * spr, "loop"), where
                _check_structure(s)
                kinds = {part.kind for _, _, a in s.iter_actions() for part in a.compute_parts()}
                if name in SPLIT:
                    assert Kind.B not in kinds, where
                elif name != "dualpipev":
                    assert kinds == {Kind.F, Kind.B}, where
                validate(s)
                low = lower(s)
                validate(low)
                _check_comm(s, low)


@pytest.mark.parametrize("p", RANKS)
def test_dualpipev_overlaps_forward_of_one_chunk_with_backward_of_the_other(p):
    for m in (2 * p, 2 * p + 1, 3 * p):
        s = make_schedule("dualpipev", p, m)
        for r, acts in enumerate(s.actions):
            overlaps = [a for a in acts if a.kind is Kind.OVERLAP_F_B]
            assert overlaps, f"P={p} M={m}: rank {r} has no overlap action"
            for a in overlaps:
                f, b = a.parts
                assert (f.kind, b.kind) == (Kind.F, Kind.B), str(a)
                assert {f.stage, b.stage} == {r, 2 * p - 1 - r}, str(a)


# ---------------------------------------------------------------------------------------------
# Simulated bubbles and memory against the closed forms (zero comm)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_ratio(name):
    """Whole-step bubble ratio (P-1)/(M+P-1) on every rank with f = b = w = 1 (B = b + w)."""
    for p in RANKS:
        for m in _micro(p):
            res = _sim(make_schedule(name, p, m))
            want = (p - 1) / (m + p - 1)
            assert res.bubble_ratio == pytest.approx(want, abs=1e-12), (p, m)
            assert res.bubble_ratio_per_rank == pytest.approx([want] * p, abs=1e-12), (p, m)


def test_1f1b_gpipe_and_looped_bfs_peak_activations():
    """1F1B: rank r holds min(P-r, M) live activations (P-r once M >= P); GPipe: M; looped
    BFS with v stages per rank: vM."""
    for p in RANKS:
        for m in _micro(p):
            assert _sim(make_schedule("looped-bfs", p, m, 3)).peak_stage_activations == [3 * m] * p
            assert _sim(make_schedule("1f1b", p, m)).peak_stage_activations == [
                min(p - r, m) for r in range(p)
            ]
            assert _sim(make_schedule("gpipe", p, m)).peak_stage_activations == [m] * p


@pytest.mark.parametrize("cost", [(1, 1, 1), (1, 2, 0.5), (2, 1, 1)])
@pytest.mark.parametrize("name", ["interleaved-1f1b", "looped-bfs"])
def test_interleaved_and_looped_bfs_bubble(name, cost):
    """Whole-step bubble time (P-1)(F+B+W)/v on every rank for M >= P, multiple of P or not,
    where F, B, W are a rank's per-microbatch totals (v stages, each taking f, b, w)."""
    f, b, w = cost
    for v in (2, 3):
        for p in RANKS:
            for m in (p, p + 1, 2 * p + 1, 3 * p):
                res = _sim(make_schedule(name, p, m, v), f, b, w)
                tf, tb, tw = v * f, v * b, v * w
                want = (p - 1) * (tf + tb + tw) / v
                assert _idle(res) == pytest.approx([want] * p, abs=1e-9), (v, p, m)


@pytest.mark.parametrize("cost", [(1, 1, 1), (2, 2, 1), (3, 2, 1), (1, 1, 0.5)])
def test_zb_h1_bubble(cost):
    """Whole-step bubble time (P-1)(F+B-W) per rank for M >= P and w <= min(f, b), with F, B,
    W a rank's per-microbatch totals divided by v (per-stage times f, b, w; B means the input
    gradient). v = 1 is the paper's ZB-H1; f = b = w = 1 gives P-1, a third of 1F1B's."""
    f, b, w = cost
    for v in (1, 2, 3):
        for p in RANKS:
            for m in (p, p + 1, 2 * p + 1):
                res = _sim(make_schedule("zb-h1", p, m, v), f, b, w)
                want = (p - 1) * (v * f + v * b - v * w) / v
                assert _idle(res) == pytest.approx([want] * p, abs=1e-9), (v, p, m)


def test_zb_h1_keeps_p_microbatches_in_flight():
    """Every rank holds at most P live activations (F run, W not yet): 1F1B's rank-0 peak."""
    for p in RANKS:
        for m in (p, 2 * p + 1):
            assert _sim(make_schedule("zb-h1", p, m)).peak_stage_activations == [p] * p


@pytest.mark.parametrize("c", [1, 2])
def test_zbv_zero_bubble(c):
    """f = b = w = c, M >= 2P-1: every rank is busy without a gap from its first to its last
    action (skew-excluding bubble exactly 0) and the step takes 6Mc + (P-1)c: each rank's
    only idle time is the (P-1)c start-up/drain skew. Peak live activations are 2P
    stage-units (half-size V stages: 1F1B's rank-0 memory) on every rank."""
    for p in RANKS:
        for m in (2 * p - 1, 2 * p, 2 * p + 1, 3 * p):
            res = _sim(make_schedule("zbv", p, m), c, c, c)
            assert res.bubble_ratio_per_rank_excl_skew == [0.0] * p, (p, m)
            assert res.makespan == 6 * m * c + (p - 1) * c, (p, m)
            assert _idle(res) == pytest.approx([(p - 1) * c] * p, abs=1e-9), (p, m)
            assert res.peak_stage_activations == [2 * p] * p, (p, m)


def test_zbv_bubble_below_2p_minus_1_microbatches_is_larger():
    """With M < 2P-1 the shape is truncated: valid, but idle time exceeds the (P-1) skew."""
    for p in range(2, 9):
        res = _sim(make_schedule("zbv", p, p))
        assert min(_idle(res)) > p - 1


@pytest.mark.parametrize("cost", [(1, 1, 1), (2, 2, 1), (1, 1, 0.5)])
def test_dualpipev_bubble(cost):
    """f = b, w <= b, M >= 2P-1: whole-step bubble time on every rank is DualPipe's
    (P-1)(F&B + B - 3W), with F&B the overlap action's time (f+b+w: its parts one after
    another), B a full backward (b+w) and W a weight gradient: 2(P-1) at f = b = w = 1."""
    f, b, w = cost
    for p in RANKS:
        for m in (2 * p - 1, 2 * p, 2 * p + 1, 3 * p):
            res = _sim(make_schedule("dualpipev", p, m), f, b, w)
            want = (p - 1) * ((f + b + w) + (b + w) - 3 * w)
            assert res.makespan == pytest.approx(2 * m * (f + b + w) + want, abs=1e-9), (p, m)
            assert _idle(res) == pytest.approx([want] * p, abs=1e-9), (p, m)


def test_dualpipev_peak_activations_balanced():
    """M >= 2P: 2P+1 live stage-activations on every rank, counted in program order (an
    overlap's forward allocates before its backward frees, hence ZB-V's 2P plus one)."""
    for p in RANKS:
        for m in (2 * p, 2 * p + 1, 3 * p):
            assert _sim(make_schedule("dualpipev", p, m)).peak_stage_activations == [2 * p + 1] * p
