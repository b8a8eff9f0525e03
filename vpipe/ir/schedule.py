"""Schedule IR: actions, placements and per-rank programs, in torch.distributed.pipelining's
string and CSV formats.

An action string is ``{stage}{kind}{microbatch}`` (``0F0``, ``2I3``, ``1RECV_F0``) or the
compound overlap form ``(0F3;3B1)OVERLAP_F_B``. Parsing is strict: the whole string must match.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from vpipe.errors import ScheduleError

__all__ = ["Action", "Kind", "Schedule", "ScheduleError", "format_action", "parse_action"]


class Kind(str, Enum):
    """What an action does. Values are torch's spellings."""

    F = "F"
    B = "B"  # full backward: input and weight gradients together
    I = "I"  # input gradient only  # noqa: E741
    W = "W"  # weight gradient only, after its I
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OVERLAP_F_B = "OVERLAP_F_B"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP_F_B})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
BACKWARD_KINDS = frozenset({Kind.B, Kind.I})


class Action(NamedTuple):
    """One step of one rank's program.

    For SEND_F the stage is the sender, for RECV_F the receiver; for SEND_B the stage that
    produced the input gradient, for RECV_B the stage that consumes it as output gradient.
    An overlap action has ``stage == microbatch == -1`` and its sub-actions in ``parts``.
    """

    stage: int
    kind: Kind
    microbatch: int
    parts: tuple[Action, ...] = ()

    def __str__(self) -> str:
        return format_action(self)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def compute_parts(self) -> tuple[Action, ...]:
        """The plain compute actions this action performs (itself, or an overlap's parts)."""
        return self.parts if self.kind is Kind.OVERLAP_F_B else (self,)


def overlap(*parts: Action) -> Action:
    """Build the compound ``(a;b)OVERLAP_F_B`` action from plain compute actions."""
    for p in parts:
        if p.kind not in (Kind.F, Kind.B, Kind.I, Kind.W):
            raise ScheduleError(f"overlap parts must be F/B/I/W actions, got {format_action(p)!r}")
    if len(parts) < 2:
        raise ScheduleError("an overlap action needs at least two parts")
    return Action(-1, Kind.OVERLAP_F_B, -1, tuple(parts))


_KIND_ALTERNATION = "SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W"
_SIMPLE_RE = re.compile(rf"(\d+)({_KIND_ALTERNATION})(\d+)")
_OVERLAP_RE = re.compile(r"\(([^()]*)\)OVERLAP_F_B")
# torch's lowered dumps also carry FSDP bookkeeping cells; they do not affect the pipeline order.
_FSDP_ONLY_RE = re.compile(r"\d+(UNSHARD|RESHARD|REDUCE_GRAD)\d*")


def _describe(text: str) -> str:
    shown = text if len(text) <= 40 else text[:37] + "..."
    return repr(shown)


@lru_cache(maxsize=65536)
def parse_action(text: str) -> Action:
    """Parse one action string strictly; raise ScheduleError naming the bad text."""
    if not isinstance(text, str):
        raise ScheduleError(f"action must be a string, got {type(text).__name__}")
    s = text.strip()
    m = _SIMPLE_RE.fullmatch(s)
    if m:
        return Action(int(m.group(1)), Kind(m.group(2)), int(m.group(3)))
    m = _OVERLAP_RE.fullmatch(s)
    if m:
        inner = [p.strip() for p in m.group(1).split(";")]
        parts = []
        for p in inner:
            pm = _SIMPLE_RE.fullmatch(p)
            if not pm or pm.group(2) not in ("F", "B", "I", "W"):
                raise ScheduleError(
                    f"invalid overlap part {_describe(p)} in {_describe(s)}: "
                    "expected compute actions like 0F3 or 3B1"
                )
            parts.append(Action(int(pm.group(1)), Kind(pm.group(2)), int(pm.group(3))))
        return overlap(*parts)
    raise ScheduleError(
        f"invalid action {_describe(s)}: expected {{stage}}{{kind}}{{microbatch}} such as 0F0, "
        "2I3, 1RECV_F0 or (0F3;3B1)OVERLAP_F_B, with kind one of F, B, I, W, SEND_F, RECV_F, "
        "SEND_B, RECV_B"
    )


def format_action(action: Action) -> str:
    """The torch-compatible string of an action."""
    if action.kind is Kind.OVERLAP_F_B:
        return "(" + ";".join(format_action(p) for p in action.parts) + ")OVERLAP_F_B"
    return f"{action.stage}{action.kind.value}{action.microbatch}"


# ---------------------------------------------------------------------------------------------
# Placement


def loop_placement(n_ranks: int, n_stages: int) -> dict[int, int]:
    """Stage s on rank s mod P (GPipe, 1F1B, interleaved schedules)."""
    return {s: s % n_ranks for s in range(n_stages)}


def v_placement(n_ranks: int, n_stages: int | None = None) -> dict[int, int]:
    """Zig-zag placement: rank r holds stages r and 2P-1-r (and 2P+r, 4P-1-r, ... for more).

    With 2P stages the last rank holds the adjacent stages P-1 and P, and the loss stage 2P-1
    lives on rank 0.
    """
    n_stages = 2 * n_ranks if n_stages is None else n_stages
    if n_stages % (2 * n_ranks):
        raise ScheduleError(
            f"v placement needs a multiple of 2*ranks stages ({2 * n_ranks}), got {n_stages}"
        )
    out = {}
    for s in range(n_stages):
        chunk, offset = divmod(s, n_ranks)
        out[s] = offset if chunk % 2 == 0 else n_ranks - 1 - offset
    return out


def make_placement(style: str, n_ranks: int, n_stages: int) -> dict[int, int]:
    """Build a placement by style name: ``loop`` or ``v``."""
    if style == "loop":
        return loop_placement(n_ranks, n_stages)
    if style == "v":
        return v_placement(n_ranks, n_stages)
    raise ScheduleError(f"unknown placement style {style!r}: use 'loop', 'v' or an explicit map")


def placement_style(placement: Mapping[int, int], n_ranks: int) -> str:
    """Name a placement: ``loop``, ``v`` or ``custom``."""
    n = len(placement)
    if dict(placement) == loop_placement(n_ranks, n):
        return "loop"
    if n % (2 * n_ranks) == 0 and dict(placement) == v_placement(n_ranks, n):
        return "v"
    return "custom"


# ---------------------------------------------------------------------------------------------
# Schedule


@dataclass(eq=False)
class Schedule:
    """One ordered action list per rank, plus the stage -> rank placement.

    ``actions[r]`` is rank r's program. A schedule is *lowered* when it contains SEND/RECV
    actions (see :func:`vpipe.ir.lowering.lower`). ``name`` and ``meta`` describe how it was
    made (the family, its options); ``==`` compares the program alone (ranks, stages,
    microbatches, placement and actions: what the CSV format holds), so a schedule read back
    from its CSV file equals the one written.
    """

    n_ranks: int
    n_stages: int
    n_microbatches: int
    placement: dict[int, int]
    actions: list[list[Action]]
    name: str = "custom"
    meta: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.actions) != self.n_ranks:
            raise ScheduleError(
                f"schedule has {len(self.actions)} action lists for {self.n_ranks} ranks"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self._program() == other._program()

    __hash__ = None  # type: ignore[assignment]  # mutable: not a dict key

    def _program(self) -> tuple:
        return self.n_ranks, self.n_stages, self.n_microbatches, self.placement, self.actions

    # -- structure ---------------------------------------------------------------------------
    @property
    def style(self) -> str:
        """``loop``, ``v`` or ``custom``."""
        return placement_style(self.placement, self.n_ranks)

    @property
    def stages_per_rank(self) -> int:
        return self.n_stages // self.n_ranks

    @property
    def loss_stage(self) -> int:
        return self.n_stages - 1

    @property
    def loss_rank(self) -> int:
        """The rank that holds the last stage (rank 0 in a V placement)."""
        return self.placement[self.n_stages - 1]

    @property
    def is_lowered(self) -> bool:
        return any(a.is_comm for acts in self.actions for a in acts)

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def stages_of(self, rank: int) -> list[int]:
        """The stages held by a rank, ascending."""
        return sorted(s for s, r in self.placement.items() if r == rank)

    def iter_actions(self) -> Iterator[tuple[int, int, Action]]:
        """Yield (rank, position, action) over the whole schedule."""
        for r, acts in enumerate(self.actions):
            for i, a in enumerate(acts):
                yield r, i, a

    def compute_only(self) -> Schedule:
        """A copy with communication actions removed."""
        return self.replace_actions([[a for a in acts if not a.is_comm] for acts in self.actions])

    def replace_actions(self, actions: list[list[Action]]) -> Schedule:
        return Schedule(
            self.n_ranks,
            self.n_stages,
            self.n_microbatches,
            dict(self.placement),
            actions,
            self.name,
            dict(self.meta),
        )

    def n_compute_actions(self) -> int:
        return sum(len(a.compute_parts()) for acts in self.actions for a in acts if a.is_compute)

    # -- text forms --------------------------------------------------------------------------
    def to_rows(self) -> list[list[str]]:
        return [[format_action(a) for a in acts] for acts in self.actions]

    def to_csv(self, path: str | Path | None = None) -> str:
        """Write torch's CSV format (one row per rank, one cell per action); return the text."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for row in self.to_rows():
            writer.writerow(row)
        text = buf.getvalue()
        if path is not None:
            _atomic_write_text(Path(path), text)
        return text

    @classmethod
    def from_csv(
        cls,
        path_or_text: str | Path,
        *,
        n_ranks: int | None = None,
        n_stages: int | None = None,
        n_microbatches: int | None = None,
        placement: Mapping[int, int] | None = None,
        name: str | None = None,
    ) -> Schedule:
        """Load torch's CSV format (file path, or the text itself when it contains a newline
        or comma). Empty cells (torch's idle slots) and FSDP-only cells (UNSHARD, RESHARD,
        REDUCE_GRAD) are skipped. Placement, stage and
        microbatch counts are inferred unless given; every error names file, line and cell."""
        path_or_text = str(path_or_text)
        if "\n" in path_or_text or "," in path_or_text:
            text, source = path_or_text, "<csv text>"
        else:
            p = Path(path_or_text)
            source = str(p)
            try:
                raw = p.read_bytes()
            except OSError as e:
                raise ScheduleError(f"{source}: cannot read: {e.strerror or e}") from None
            if b"\x00" in raw:
                raise ScheduleError(f"{source}: not a CSV text file (contains NUL bytes)")
            try:
                text = raw.decode("utf-8-sig")
            except UnicodeDecodeError as e:
                raise ScheduleError(f"{source}: not UTF-8 text (byte {e.start})") from None
        rows = _parse_csv_rows(text, source)
        if n_ranks is not None and len(rows) != n_ranks:
            raise ScheduleError(
                f"{source}: expected {n_ranks} rows (one per rank), got {len(rows)}"
            )
        return schedule_from_rows(
            rows,
            source=source,
            n_stages=n_stages,
            n_microbatches=n_microbatches,
            placement=placement,
            name=name or (Path(source).stem if source != "<csv text>" else "csv"),
        )

    def format_grid(self, width: int | None = None) -> str:
        """A readable table: one row per rank, one column per program slot."""
        rows = self.to_rows()
        cell = width or max((len(c) for row in rows for c in row), default=3)
        lines = []
        for r, row in enumerate(rows):
            lines.append(f"rank {r:>2} | " + " ".join(c.ljust(cell) for c in row))
        return "\n".join(lines)


def _parse_csv_rows(text: str, source: str) -> list[list[tuple[int, Action]]]:
    if not text.strip():
        raise ScheduleError(f"{source}: empty file: expected one CSV row of actions per rank")
    try:
        raw_rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as e:
        raise ScheduleError(f"{source}: malformed CSV: {e}") from None
    # Trailing blank lines are not ranks.
    while raw_rows and not any(c.strip() for c in raw_rows[-1]):
        raw_rows.pop()
    rows: list[list[tuple[int, Action]]] = []
    for line_no, raw in enumerate(raw_rows, start=1):
        row = []
        for col, cell in enumerate(raw, start=1):
            if not cell.strip() or cell.strip() == "None" or _FSDP_ONLY_RE.fullmatch(cell.strip()):
                continue  # torch's idle slots (empty cells) and FSDP-only cells
            try:
                row.append((col, parse_action(cell)))
            except ScheduleError as e:
                raise ScheduleError(
                    f"{source}:{line_no}: rank {line_no - 1}, cell {col}: {e}"
                ) from None
        rows.append(row)
    return rows


def schedule_from_rows(
    rows: Sequence[Sequence[tuple[int, Action]]] | Sequence[Sequence[Action]],
    *,
    source: str = "<rows>",
    n_stages: int | None = None,
    n_microbatches: int | None = None,
    placement: Mapping[int, int] | None = None,
    name: str = "custom",
) -> Schedule:
    """Build a Schedule from per-rank action lists, inferring placement and sizes."""
    n_ranks = len(rows)
    if n_ranks == 0:
        raise ScheduleError(f"{source}: no ranks")
    actions: list[list[Action]] = []
    inferred: dict[int, int] = {}
    max_stage, max_mb = -1, -1
    for r, row in enumerate(rows):
        acts = []
        for item in row:
            col, a = (
                item if isinstance(item, tuple) and not isinstance(item, Action) else (None, item)
            )
            acts.append(a)
            for p in a.compute_parts() if a.is_compute else (a,):
                max_stage = max(max_stage, p.stage)
                max_mb = max(max_mb, p.microbatch)
                if p.is_compute:
                    prev = inferred.setdefault(p.stage, r)
                    if prev != r:
                        where = f", cell {col}" if col else ""
                        raise ScheduleError(
                            f"{source}:{r + 1}: rank {r}{where}: action {format_action(p)} runs "
                            f"stage {p.stage}, which rank {prev} also runs (a stage lives on one rank)"
                        )
        actions.append(acts)
    n_stages = n_stages if n_stages is not None else max_stage + 1
    n_microbatches = n_microbatches if n_microbatches is not None else max_mb + 1
    if placement is None:
        missing = [s for s in range(n_stages) if s not in inferred]
        if missing:
            raise ScheduleError(
                f"{source}: stage {missing[0]} has no compute action, so its rank is unknown"
            )
        placement = inferred
    return Schedule(n_ranks, n_stages, n_microbatches, dict(placement), actions, name)


def _atomic_write_text(path: Path, text: str) -> None:
    from vpipe.outputs import atomic_write

    atomic_write(path, lambda tmp: tmp.write_text(text))


def actions_from_strings(rows: Iterable[Iterable[str]]) -> list[list[Action]]:
    """Parse per-rank lists of action strings (convenient in tests and examples)."""
    return [[parse_action(s) for s in row] for row in rows]
