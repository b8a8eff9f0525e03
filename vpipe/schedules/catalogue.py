"""The schedule catalogue: one row per schedule family, the source of every list of names.

Each :class:`Family` says how to generate the schedule and how the rest of vpipe treats it:
its placement, torch.distributed.pipelining's class for it (if any), where it sits in tables
and plots, whether it is the comparison baseline and whether the default and quick sweeps run
it. Lookups read the catalogue when called, so a family added with :func:`register` (by a
plugin or a test) shows up in ``vpipe schedules``, ``vpipe compare``, sweeps, plots and
reports alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from vpipe.errors import ScheduleError
from vpipe.ir import Schedule
from vpipe.schedules.auto import auto, catalogue_adapted
from vpipe.schedules.controllable import zb_h2
from vpipe.schedules.interleaved import interleaved_1f1b, looped_bfs, zb_h1
from vpipe.schedules.simple import gpipe, one_f_one_b
from vpipe.schedules.v import dualpipev, zbv

__all__ = [
    "Family",
    "Generator",
    "LiveView",
    "baseline",
    "canonical",
    "families",
    "get",
    "names",
    "register",
    "unregister",
]

Generator = Callable[[int, int, "int | None"], Schedule]
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Family:
    """One schedule family and how vpipe uses it.

    ``stages_per_rank`` is the generator's default; ``torch_class`` names the
    torch.distributed.pipelining class running the same schedule (None: vpipe only), and
    ``torch_multi`` says that class takes a list of stages. ``order`` places the family in
    listings, tables and plots (lower first). ``cost_adapted``: the generator also takes
    ``costs=`` (per-stage costs, see :class:`vpipe.schedules.auto.StageCosts`) and schedules
    for them; without them it schedules for unit costs (:func:`vpipe.schedules.make_schedule`).
    """

    name: str
    generator: Generator
    description: str
    placement: str
    stages_per_rank: int
    torch_class: str | None = None
    torch_multi: bool = False
    order: int = 1000
    baseline: bool = False
    default_sweep: bool = False
    quick_sweep: bool = False
    aliases: tuple[str, ...] = ()
    cost_adapted: bool = False

    def spellings(self) -> tuple[str, ...]:
        """Every name that means this family, case-insensitively: its own, its aliases, and
        torch's class name with and without the ``Schedule`` prefix (what torchtitan's
        ``pipeline_parallel_schedule`` takes: ``Interleaved1F1B``, ``ZBVZeroBubble``...)."""
        torch = (
            (self.torch_class, self.torch_class.removeprefix("Schedule"))
            if self.torch_class
            else ()
        )
        return tuple(dict.fromkeys(n.lower() for n in (self.name, *self.aliases, *torch)))

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name or any(c in name for c in ", \t\n"):
            raise ScheduleError(
                f"schedule family name {name!r} must be a non-empty string without commas or "
                "whitespace"
            )
        if self.placement not in PLACEMENTS:
            raise ScheduleError(
                f"family {name}: placement must be one of {', '.join(PLACEMENTS)}, "
                f"got {self.placement!r}"
            )
        if not isinstance(self.stages_per_rank, int) or self.stages_per_rank < 1:
            raise ScheduleError(
                f"family {name}: stages_per_rank must be a positive integer, "
                f"got {self.stages_per_rank!r}"
            )
        if self.torch_multi and self.torch_class is None:
            raise ScheduleError(f"family {name}: torch_multi needs a torch_class")


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family to the catalogue; names (and every spelling of them) are unique and only
    one family is the baseline."""
    if family.name in _FAMILIES:
        raise ScheduleError(f"schedule family {family.name!r} is already registered")
    taken = {s: f.name for f in _FAMILIES.values() for s in f.spellings()}
    clash = next((s for s in family.spellings() if s in taken), None)
    if clash is not None:
        raise ScheduleError(
            f"family {family.name}: the name {clash!r} already means {taken[clash]}"
        )
    if family.baseline and any(f.baseline for f in _FAMILIES.values()):
        raise ScheduleError(
            f"family {family.name}: the catalogue already has a baseline ({baseline()})"
        )
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> Family:
    """Remove a family (for tests and plugins that clean up); returns it."""
    family = get(name)
    del _FAMILIES[name]
    return family


def families() -> tuple[Family, ...]:
    """Every family in display order."""
    return tuple(sorted(_FAMILIES.values(), key=lambda f: (f.order, f.name)))


def names(where: Callable[[Family], bool] = lambda f: True) -> tuple[str, ...]:
    """Names of the families ``where`` accepts, in display order."""
    return tuple(f.name for f in families() if where(f))


def get(name: str) -> Family:
    """The family ``name`` means (any spelling, see :meth:`Family.spellings`); an unknown name
    lists the known ones."""
    family = _FAMILIES.get(name) if isinstance(name, str) else None
    if family is None and isinstance(name, str):
        low = name.lower()
        family = next((f for f in _FAMILIES.values() if low in f.spellings()), None)
    if family is None:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(names())}")
    return family


def canonical(name: str) -> str:
    """vpipe's name for a family given any of its spellings (``DualPipeV`` -> ``dualpipev``);
    a name the catalogue does not know is returned as it is, for the caller to report."""
    try:
        return get(name).name
    except ScheduleError:
        return name


def display_order(present: Iterable[str]) -> list[str]:
    """The given schedule names in display order: catalogued families as :func:`names` orders
    them (baselines first), unknown names after them, sorted."""
    present = set(present)
    known = [s for s in names() if s in present]
    return known + sorted(present - set(known))


def baseline() -> str:
    """The family every other is compared with (interleaved-1f1b)."""
    found = names(lambda f: f.baseline)
    if not found:
        raise ScheduleError("the schedule catalogue has no baseline family")
    return found[0]


T = TypeVar("T")


class LiveView(Mapping[str, T], Generic[T]):
    """A read-only ``name -> value`` mapping over the catalogue as it is at each access:
    ``value(family)`` for every family in display order, skipping those it maps to None."""

    def __init__(self, value: Callable[[Family], T | None]) -> None:
        self._value = value

    def _items(self) -> dict[str, T]:
        out = {}
        for f in families():
            v = self._value(f)
            if v is not None:
                out[f.name] = v
        return out

    def __getitem__(self, name: str) -> T:
        return self._items()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return f"LiveView({self._items()!r})"


for _family in (
    Family(
        "gpipe",
        gpipe,
        "all forwards, then all backwards; 1 stage/rank; any P, M",
        placement="loop",
        stages_per_rank=1,
        torch_class="ScheduleGPipe",
        order=10,
    ),
    Family(
        "1f1b",
        one_f_one_b,
        "warm-up, one forward one backward, drain; 1 stage/rank; any P, M",
        placement="loop",
        stages_per_rank=1,
        torch_class="Schedule1F1B",
        order=20,
        default_sweep=True,
    ),
    Family(
        "interleaved-1f1b",
        interleaved_1f1b,
        "Megatron virtual pipeline: v stages/rank (default 2), loop placement; any P, M, v",
        placement="loop",
        stages_per_rank=2,
        torch_class="ScheduleInterleaved1F1B",
        torch_multi=True,
        order=30,
        baseline=True,
        default_sweep=True,
        quick_sweep=True,
    ),
    Family(
        "looped-bfs",
        looped_bfs,
        "breadth-first: all microbatches stage by stage; v stages/rank (default 2); any P, M, v",
        placement="loop",
        stages_per_rank=2,
        torch_class="ScheduleLoopedBFS",
        torch_multi=True,
        order=40,
    ),
    Family(
        "zb-h1",
        zb_h1,
        "zero bubble H1: 1F1B memory, I/W split, W's fill the drain; v stages/rank (default 1)",
        placement="loop",
        stages_per_rank=1,
        torch_class="ScheduleInterleavedZeroBubble",
        torch_multi=True,
        order=50,
        default_sweep=True,
    ),
    Family(
        "zb-h2",
        zb_h2,
        "zero bubble H2: 2P-1 microbatches in flight, W's fill the drain; 1 stage/rank; any P, M",
        placement="loop",
        stages_per_rank=1,
        order=55,
    ),
    Family(
        "zbv",
        zbv,
        "zero bubble V: V placement, 2 stages/rank, I/W split; any P, M",
        placement="v",
        stages_per_rank=2,
        torch_class="ScheduleZBVZeroBubble",
        torch_multi=True,
        order=60,
        default_sweep=True,
        quick_sweep=True,
        aliases=("v-zb",),
    ),
    Family(
        "v-half",
        catalogue_adapted("v-half"),
        "controllable memory V-Half: the best schedule auto finds for the costs (unit costs by "
        "default) within V-Half's memory, floor((P+2)/2) 1F1B stages; I/W split; 2 stages/rank",
        placement="v",
        stages_per_rank=2,
        order=62,
        cost_adapted=True,
    ),
    Family(
        "v-min",
        catalogue_adapted("v-min"),
        "controllable memory V-Min: the best schedule auto finds for the costs (unit costs by "
        "default) within V-Min's memory, floor((P+4)/3) 1F1B stages; I/W split; 2 stages/rank",
        placement="v",
        stages_per_rank=2,
        order=64,
        cost_adapted=True,
    ),
    Family(
        "dualpipev",
        dualpipev,
        "DeepSeek DualPipeV: V placement, 2 stages/rank, (F;B) overlap actions; any P, M",
        placement="v",
        stages_per_rank=2,
        torch_class="ScheduleDualPipeV",
        torch_multi=True,
        order=70,
        default_sweep=True,
    ),
    Family(
        "auto",
        auto,
        "best schedule for a cost model and memory limit: list scheduler, blocks, families "
        "(for the costs, unit costs by default; limit 2x 1F1B's); 2 stages/rank",
        placement="v",
        stages_per_rank=2,
        order=90,
        cost_adapted=True,
    ),
):
    register(_family)
del _family
