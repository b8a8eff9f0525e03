"""The simulator's cost model: compute times per kind and stage, message costs, the runtime's
per-action overheads and activation bytes, and its text form (``f=1,b=1,w=1,comm=0``).

One cost convention for every cost string (``vpipe simulate``, ``compare``, ``plan``, and
:meth:`CostModel.parse` in Python): :data:`COST_CONVENTION`. A model built in Python with
``CostModel(...)`` is per stage unless it says ``unit="rank"``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from vpipe.errors import VpipeError
from vpipe.ir.engine import LinkModel

__all__ = [
    "COST_CONVENTION",
    "CostModel",
    "CostModelError",
    "PerStage",
    "parse_numbers",
    "read_json_object",
    "split_unit",
]

COST_CONVENTION = (
    "f, b, w (and act_bytes) are the times (bytes) of one rank's share of the model (1/P of it: "
    "a whole stage when each rank holds one) for one microbatch; a schedule with V stages per "
    "rank gives each stage 1/V of them (unit=rank, the default; unit=stage gives them per "
    "stage where a single schedule is simulated). comm, handshake, post and gap are per "
    "message or action, whatever V"
)
UNITS = ("rank", "stage")


class CostModelError(VpipeError, ValueError):
    """A cost model (or its text form) is invalid."""


PerStage = float | Sequence[float] | Mapping[int, float]


@dataclass(frozen=True)
class CostModel:
    """Times per compute kind, optionally per stage, and communication costs.

    ``f``: forward; ``b``: input gradient (I); ``w``: weight gradient (W); a full backward B
    costs ``b + w`` and an overlap action the sum of its parts. ``per_stage`` overrides them
    per stage: ``{stage: {"f": 2.0, "w": 0.5}}``, and its key ``"B"`` gives a stage's full
    backward its own time (a run can measure B beside I and W: one pass is not their sum). A message over the boundary between stages
    s and s+1 (either direction) costs ``comm_latency + comm_bytes[s] / comm_bandwidth``, and
    ``comm_handshake`` more when its RECV is posted after its SEND (a rendezvous transport;
    :class:`vpipe.ir.engine.LinkModel`).
    ``comm_bytes`` and ``activation_bytes`` (per stage, for peak memory) are a number for
    all stages/boundaries, a sequence, or a mapping. ``boundary_time``, when given, is the time
    of one message over each boundary instead (links that differ by boundary: a layout whose
    stages sit on the same node or on different ones, :mod:`vpipe.sim.model_costs`).

    ``post`` and ``gap`` are what the runtime pays besides computing and waiting: ``post`` per
    SEND or RECV it posts, ``gap`` per action (its own work between actions). A rank pays them
    where its program has them: before a compute action, for that action and the SENDs and
    RECVs since the previous one; after its last compute action, for the SENDs and RECVs that
    follow it. They occupy the rank but are not busy time (as in a measured step).

    ``recompute`` and ``recompute_bytes`` model activation recomputation
    (:mod:`vpipe.runtime.recompute`): each B and each I also reruns ``recompute`` times its
    stage's forward (1 for full recomputation; a number, or per stage: selective recomputation
    reruns a share that differs by stage), and holds ``recompute_bytes`` (per stage) while
    a B runs and from an I until its W; ``activation_bytes`` are then what F keeps.

    ``overlap`` scales the parts of an overlap action (``(0F3;3B1)OVERLAP_F_B``): what running
    them together costs relative to running them apart (1: no gain; calibration measures it).

    ``unit``: ``"stage"`` (the default here) means f, b, w, ``per_stage`` and
    ``activation_bytes`` are per stage; ``"rank"`` means per rank's share of the model, split
    evenly over a schedule's stages per rank (:meth:`for_schedule`; the convention of cost
    strings, :data:`COST_CONVENTION`).
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm_latency: float = 0.0
    comm_bandwidth: float = math.inf
    per_stage: Mapping[int, Mapping[str, float]] | None = None
    activation_bytes: PerStage | None = None
    comm_bytes: PerStage = 0.0
    post: float = 0.0
    gap: float = 0.0
    overlap: float = 1.0
    comm_handshake: float = 0.0
    unit: str = "stage"
    boundary_time: PerStage | None = None
    recompute: PerStage = 0.0
    recompute_bytes: PerStage | None = None

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise CostModelError(f"unit must be 'rank' or 'stage', got {self.unit!r}")
        for name in ("f", "b", "w", "comm_latency", "comm_handshake", "post", "gap", "overlap"):
            _non_negative(name, getattr(self, name))
        if isinstance(self.recompute, (int, float)):
            _non_negative("recompute", self.recompute)
        bw = self.comm_bandwidth
        if not isinstance(bw, (int, float)) or math.isnan(bw) or bw <= 0:
            raise CostModelError(f"comm_bandwidth must be a positive number, got {bw!r}")
        for stage, over in (self.per_stage or {}).items():
            for key, value in over.items():
                if key not in ("f", "b", "w", "B"):
                    raise CostModelError(
                        f"per_stage[{stage}] has unknown key {key!r}: use 'f', 'b', 'w' or 'B'"
                    )
                _non_negative(f"per_stage[{stage}][{key!r}]", value)

    _ALIASES = {
        "f": "f",
        "b": "b",
        "w": "w",
        "comm": "comm_latency",
        "latency": "comm_latency",
        "comm_latency": "comm_latency",
        "handshake": "comm_handshake",
        "comm_handshake": "comm_handshake",
        "bw": "comm_bandwidth",
        "bandwidth": "comm_bandwidth",
        "comm_bandwidth": "comm_bandwidth",
        "bytes": "comm_bytes",
        "comm_bytes": "comm_bytes",
        "act_bytes": "activation_bytes",
        "activation_bytes": "activation_bytes",
        "post": "post",
        "gap": "gap",
        "overlap": "overlap",
        "recompute": "recompute",
        "recompute_bytes": "recompute_bytes",
    }

    @classmethod
    def parse(cls, text: str) -> CostModel:
        """Parse ``"f=1,b=1,w=1,comm=0"``. Keys: f, b, w, comm (latency), handshake (added to
        a message whose receive is posted after its send), bw (bandwidth,
        bytes per time unit), bytes (per boundary), act_bytes (per stage), post (per SEND or
        RECV posted), gap (per action), overlap (an overlap action's parts cost this times
        their separate costs), recompute (B and I rerun this share of F) and recompute_bytes
        (per stage, held by a recomputing backward), plus the field names, and ``unit=rank`` (the default) or
        ``unit=stage`` (:data:`COST_CONVENTION`). Unspecified keys keep their defaults."""
        text, unit = split_unit(text, "cost", CostModelError)
        if "rows" in {item.partition("=")[0].strip() for item in text.split(",")}:
            raise CostModelError(
                "rows= is vpipe plan's key (it rescales the costs to each microbatch size); "
                "here the costs are those of the microbatch simulated: drop rows, or multiply "
                "f, b, w and act_bytes by (rows of the simulated microbatch) / rows"
            )
        values = parse_numbers(text, cls._ALIASES, "cost", CostModelError)
        kwargs = {cls._ALIASES[k]: v for k, v in values.items()}
        return cls(**kwargs, unit=unit)

    def for_schedule(self, stages_per_rank: int) -> CostModel:
        """The per-stage model of a schedule with ``stages_per_rank`` stages per rank: this one
        if it is per stage; else its f, b, w, per-stage overrides and activation bytes / V."""
        if self.unit == "stage":
            return self
        v = stages_per_rank
        per_stage = self.per_stage and {
            s: {k: t / v for k, t in over.items()} for s, over in self.per_stage.items()
        }
        return replace(self, f=self.f / v, b=self.b / v, w=self.w / v, per_stage=per_stage,
                       activation_bytes=_divided(self.activation_bytes, v),
                       recompute_bytes=_divided(self.recompute_bytes, v), unit="stage")  # fmt: skip

    def stage_times(self, n_stages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Arrays (f, b, w) per stage; b (I) includes its recomputation."""
        out = [np.full(n_stages, float(getattr(self, k))) for k in ("f", "b", "w")]
        for stage, over in (self.per_stage or {}).items():
            if not 0 <= stage < n_stages:
                raise CostModelError(f"per_stage names stage {stage}, outside 0..{n_stages - 1}")
            for j, k in enumerate(("f", "b", "w")):
                if k in over:
                    out[j][stage] = float(over[k])
        return out[0], out[1] + self.recompute_shares(n_stages) * out[0], out[2]

    def recompute_shares(self, n_stages: int) -> np.ndarray:
        """The share of its forward each stage's B and I rerun (0 without recomputation)."""
        return _per_stage("recompute", self.recompute, n_stages)

    def backward_times(self, n_stages: int) -> np.ndarray:
        """A full backward's time per stage: ``b + w`` (b with its recomputation), or the
        stage's ``per_stage`` "B" plus its recomputation."""
        f, b, w = self.stage_times(n_stages)
        out = b + w
        share = self.recompute_shares(n_stages)
        for stage, over in (self.per_stage or {}).items():
            if "B" in over:
                out[stage] = float(over["B"]) + share[stage] * f[stage]
        return out

    def links(self, n_stages: int) -> LinkModel:
        """The link model of a schedule with ``n_stages`` stages."""
        n = max(n_stages - 1, 0)
        if self.boundary_time is not None:
            times = _per_stage("boundary_time", self.boundary_time, n)
            return LinkModel(times, math.inf, 0.0, self.comm_handshake)
        nbytes = _per_stage("comm_bytes", self.comm_bytes, n)
        return LinkModel(self.comm_latency, self.comm_bandwidth, nbytes, self.comm_handshake)

    def boundary_costs(self, n_stages: int) -> np.ndarray:
        """Time of one message over each boundary s (between stages s and s+1)."""
        return self.links(n_stages).boundary_costs()

    def stage_activation_bytes(self, n_stages: int) -> np.ndarray | None:
        if self.activation_bytes is None:
            return None
        return _per_stage("activation_bytes", self.activation_bytes, n_stages)

    def stage_recompute_bytes(self, n_stages: int) -> np.ndarray:
        """Bytes a recomputing backward holds, per stage (zeros without recomputation)."""
        if self.recompute_bytes is None:
            return np.zeros(n_stages)
        return _per_stage("recompute_bytes", self.recompute_bytes, n_stages)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for fd in fields(self):
            v = getattr(self, fd.name)
            out[fd.name] = dict(v) if isinstance(v, Mapping) else v
        return out


def parse_numbers(
    text: str, keys: Iterable[str], what: str, error: type[Exception]
) -> dict[str, float]:
    """``"a=1,b=2.5"`` as ``{"a": 1.0, "b": 2.5}``, every key one of ``keys``; a bad item is
    ``error`` naming it (``what`` says whose item it is)."""
    known = sorted(keys)
    values: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in str(text).split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise error(
                f"bad {what} item {item!r}: expected KEY=NUMBER, KEY one of {', '.join(known)}"
            )
        try:
            values[key] = float(value)
        except ValueError:
            raise error(f"bad {what} value in {item!r}: not a number") from None
    return values


def read_json_object(text: str, flag: str, presets: Iterable[str], error: type[Exception]):
    """The JSON object in file ``text`` (a ``flag`` value that is no preset) and its path; a
    missing file, bad JSON or a non-object is ``error`` naming the file (or listing
    ``presets``)."""
    import json
    from pathlib import Path

    path = Path(text)
    if not path.is_file():
        raise error(f"{flag} {text!r}: no such preset or file (presets: {', '.join(presets)})")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not a JSON file ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data, path


def split_unit(text: str, what: str, error: type[Exception]) -> tuple[str, str]:
    """``text`` without its ``unit=`` item, and that unit (``rank`` when absent)."""
    unit, rest = "rank", []
    for item in str(text).split(","):
        key, sep, value = item.partition("=")
        if key.strip() != "unit":
            rest.append(item)
        elif value.strip() in UNITS:
            unit = value.strip()
        else:
            raise error(f"bad {what} item {item.strip()!r}: unit is 'rank' or 'stage'")
    return ",".join(rest), unit


def _divided(value: PerStage | None, v: int) -> PerStage | None:
    """Per-stage bytes of a rank's share split over its ``v`` stages."""
    if isinstance(value, Mapping):
        return {k: x / v for k, x in value.items()}
    if value is None or isinstance(value, (int, float)):
        return value if value is None else value / v
    return [x / v for x in value]


def _non_negative(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or value < 0 or value == math.inf:
        raise CostModelError(f"{name} must be a finite number >= 0, got {value!r}")


def _per_stage(name: str, value: PerStage, n: int) -> np.ndarray:
    if isinstance(value, Mapping):
        out = np.zeros(n)
        for k, v in value.items():
            if not 0 <= k < n:
                raise CostModelError(f"{name} names index {k}, outside 0..{n - 1}")
            _non_negative(f"{name}[{k}]", v)
            out[k] = v
        return out
    if isinstance(value, (int, float)):
        _non_negative(name, value)
        return np.full(n, float(value))
    values = list(value)
    if len(values) != n:
        raise CostModelError(f"{name} has {len(values)} entries, expected {n}")
    for k, v in enumerate(values):
        _non_negative(f"{name}[{k}]", v)
    return np.array(values, float)
