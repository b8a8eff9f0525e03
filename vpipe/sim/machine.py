"""A machine described by the figures a cost model needs: a GPU's peak FLOP/s per precision,
its memory bandwidth and size, GPUs per node, and the links inside a node and between nodes.

Presets (:data:`PRESETS`) take every figure from the vendor's datasheet, named in
:attr:`Machine.sources`; link latencies are not datasheet figures and say so. A machine may
also be a JSON file of :class:`Machine`'s fields (``peak_flops`` a mapping of precision to
FLOP/s, bandwidths in bytes/s, latencies in seconds, ``memory`` in bytes), or a preset with
some fields replaced (``load_machine("h100", gpus_per_node=4)``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from vpipe.errors import VpipeError
from vpipe.sim.cost_model import read_json_object

__all__ = ["PRESETS", "Machine", "MachineError", "load_machine"]

GIB = 2**30


class MachineError(VpipeError, ValueError):
    """A machine description that cannot be used; the message names the file and field."""


@dataclass(frozen=True)
class Machine:
    """One GPU model in nodes of ``gpus_per_node``. Bandwidths are per GPU and direction."""

    name: str
    peak_flops: dict[str, float]  # dense, per precision ("bf16", "fp16", "fp32")
    memory_bandwidth: float  # bytes/s
    memory: float  # bytes per GPU (the datasheet's GB: 1e9 bytes, for every preset)
    gpus_per_node: int
    intra_node_bandwidth: float  # bytes/s per GPU, one direction
    inter_node_bandwidth: float  # bytes/s per GPU, one direction
    intra_node_latency: float  # s per message
    inter_node_latency: float  # s per message
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("memory_bandwidth", "memory", "intra_node_bandwidth", "inter_node_bandwidth"):
            _positive(self.name, key, getattr(self, key))
        for key in ("intra_node_latency", "inter_node_latency"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise MachineError(f"machine {self.name!r}: {key} must be >= 0 s, got {value!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise MachineError(
                f"machine {self.name!r}: gpus_per_node must be an integer >= 1, "
                f"got {self.gpus_per_node!r}"
            )
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise MachineError(f"machine {self.name!r}: peak_flops must map precisions to FLOP/s")
        for precision, value in self.peak_flops.items():
            _positive(self.name, f"peak_flops[{precision!r}]", value)

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s in ``precision``."""
        if precision not in self.peak_flops:
            raise MachineError(
                f"machine {self.name!r} gives no peak for {precision} (it has "
                f"{', '.join(self.peak_flops)})"
            )
        return float(self.peak_flops[precision])

    def link(self, same_node: bool) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of a message inside a node or between nodes."""
        if same_node:
            return self.intra_node_latency, self.intra_node_bandwidth
        return self.inter_node_latency, self.inter_node_bandwidth

    def message_time(self, nbytes: float, same_node: bool) -> float:
        latency, bandwidth = self.link(same_node)
        return latency + nbytes / bandwidth

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive(name: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
        not math.isfinite(value)
    ):
        raise MachineError(f"machine {name!r}: {key} must be a number > 0, got {value!r}")


_LATENCY = (
    "not a datasheet figure: an assumed NCCL point-to-point latency (a few microseconds in a "
    "node, about ten between nodes)"
)

PRESETS: dict[str, Machine] = {
    "a100": Machine(
        "a100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, memory_bandwidth=2039e9,
        memory=80e9, gpus_per_node=8, intra_node_bandwidth=300e9,
        inter_node_bandwidth=25e9, intra_node_latency=5e-6, inter_node_latency=10e-6,
        sources={
            "peak_flops": "NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 Tensor Core 312 "
            "TFLOPS dense (624 with sparsity), FP32 19.5 TFLOPS",
            "memory_bandwidth": "A100 datasheet: A100 80GB SXM, HBM2e, 2,039 GB/s",
            "memory": "A100 datasheet: 80GB HBM2e",
            "gpus_per_node": "NVIDIA DGX A100 datasheet: 8x A100",
            "intra_node_bandwidth": "A100 datasheet: NVLink 600 GB/s (both directions)",
            "inter_node_bandwidth": "DGX A100 datasheet: 8x single-port ConnectX-6, 200 Gb/s "
            "HDR InfiniBand (one per GPU)",
            "latency": _LATENCY,
        },
    ),
    "h100": Machine(
        "h100", {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "fp32": 67e12}, memory_bandwidth=3.35e12,
        memory=80e9, gpus_per_node=8, intra_node_bandwidth=450e9,
        inter_node_bandwidth=50e9, intra_node_latency=5e-6, inter_node_latency=10e-6,
        sources={
            "peak_flops": "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16/FP16 Tensor "
            "Core 1,979 TFLOPS with sparsity (989 dense), FP8 3,958 with sparsity (1,979 "
            "dense), FP32 67 TFLOPS",
            "memory_bandwidth": "H100 datasheet: H100 SXM, 3.35 TB/s",
            "memory": "H100 datasheet: H100 SXM 80GB",
            "gpus_per_node": "NVIDIA DGX H100 datasheet: 8x H100",
            "intra_node_bandwidth": "H100 datasheet: NVLink 900 GB/s (both directions)",
            "inter_node_bandwidth": "DGX H100 datasheet: 8x ConnectX-7, 400 Gb/s (one per GPU)",
            "latency": _LATENCY,
        },
    ),
}  # fmt: skip

# The H200 is the H100's chip and links with more and faster memory.
PRESETS["h200"] = replace(
    PRESETS["h100"], name="h200", memory_bandwidth=4.8e12, memory=141e9,
    sources={
        **PRESETS["h100"].sources,
        "peak_flops": "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16/FP16 Tensor Core "
        "1,979 TFLOPS with sparsity (989 dense), FP8 3,958 with sparsity (1,979 dense), FP32 "
        "67 TFLOPS",
        "memory_bandwidth": "H200 datasheet: 4.8 TB/s",
        "memory": "H200 datasheet: 141GB HBM3e",
        "gpus_per_node": "NVIDIA DGX H200 datasheet: 8x H200",
        "intra_node_bandwidth": "H200 datasheet: NVLink 900 GB/s (both directions)",
        "inter_node_bandwidth": "DGX H200 datasheet: 8x ConnectX-7, 400 Gb/s (one per GPU)",
    },
)  # fmt: skip

# The B200 (HGX/DGX B200, 1,000 W): a new chip, whose efficiency no published run here measures.
# Its figures are NVIDIA's 8-GPU specification tables over 8, as secondary sources quote them
# (the datasheets themselves were not at hand).
PRESETS["b200"] = Machine(
    "b200", {"bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12, "fp32": 75e12},
    memory_bandwidth=8e12, memory=180e9, gpus_per_node=8, intra_node_bandwidth=900e9,
    inter_node_bandwidth=50e9, intra_node_latency=5e-6, inter_node_latency=10e-6,
    sources={
        "peak_flops": "NVIDIA HGX B200 datasheet (8 GPUs): FP16/BF16 Tensor Core 36 PFLOPS and "
        "FP8 72 PFLOPS with sparsity, so 2,250 and 4,500 TFLOPS dense per GPU; FP32 600 "
        "TFLOPS, 75 per GPU",
        "memory_bandwidth": "NVIDIA DGX B200 datasheet: 64 TB/s HBM3e over 8 GPUs",
        "memory": "DGX B200 datasheet: 1,440 GB of GPU memory over 8 GPUs",
        "gpus_per_node": "DGX B200 datasheet: 8x NVIDIA Blackwell GPUs",
        "intra_node_bandwidth": "DGX B200 datasheet: fifth-generation NVLink, 14.4 TB/s over 8 "
        "GPUs (1.8 TB/s per GPU, both directions)",
        "inter_node_bandwidth": "DGX B200 datasheet: 8x single-port ConnectX-7, 400 Gb/s (one "
        "per GPU)",
        "latency": _LATENCY,
    },
)  # fmt: skip

_FIELDS = {f.name for f in fields(Machine)}


def load_machine(text: str, **overrides: Any) -> Machine:
    """A preset (``a100``, ``h100``, ``h200``, ``b200``) or a JSON file of :class:`Machine`
    fields (a ``"preset"`` key starts from that preset); ``overrides`` replace fields."""
    if text.lower() in PRESETS:
        machine = PRESETS[text.lower()]
    else:
        data, path = read_json_object(text, "--machine", PRESETS, MachineError)
        base = data.pop("preset", None)
        unknown = sorted(set(data) - _FIELDS)
        if unknown:
            raise MachineError(f"{path}: unknown field {unknown[0]!r} (fields: "
                               f"{', '.join(sorted(_FIELDS))}, preset)")  # fmt: skip
        if base is not None:
            if str(base).lower() not in PRESETS:
                raise MachineError(f"{path}: preset {base!r} is none of {', '.join(PRESETS)}")
            machine = replace(PRESETS[str(base).lower()], **data)
        else:
            missing = sorted(_FIELDS - set(data) - {"sources", "name"})
            if missing:
                raise MachineError(f"{path}: missing field {missing[0]!r} (or give \"preset\")")
            machine = Machine(**{"name": path.stem, **data})
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(machine, **given) if given else machine
