"""The share of a GPU's dense peak that a transformer block's passes reach, as a function of
the GEMM shapes on that GPU, with a few terms fitted per machine preset.

A block's matrices on one GPU are ``tokens x width`` products: ``tokens`` the microbatch's
tokens on the GPU (microbatch x sequence / CP), ``width`` the hidden size over TP. Small
products leave the tensor cores waiting on memory and launches, so the achieved share rises
with both and saturates:

    efficiency = peak_share[precision] * d / (d + d_half),   1 / d = 1 / tokens + 1 / width

``peak_share`` (per precision) is what the largest products reach, ``d_half`` the size at
which half of it is lost. A third term, ``tp_hidden``, is the share of tensor parallelism's
collectives the step does not see: on the H100 rows the runs overlap them (Megatron-LM's and
NeMo's ``--tp-comm-overlap``) and the fit finds all of it hidden; the 2021 A100 runs did not
overlap, so their fitted half says the ring model overstates the collectives there. The
memory-bound operators between the GEMMs are costed apart, by the bytes they move
(:func:`vpipe.sim.parallel.elementwise_bytes`). All are fitted per preset by ``python -m bench.cluster_published
--fit`` on the published development tables (``shared/data/3d-parallel``: Megatron-LM's H100
weak scaling and NeMo's H100 rows for ``h100``, the Megatron-LM paper's A100 Table 1 for
``a100``), never one term per row. There are no published H200 rows: ``h200`` reuses the
H100's terms (the same chip and clocks; only the memory differs) and its error is unknown;
so does ``b200`` (another chip: its terms are a guess until published B200 runs are fitted) and
any machine given as a file.

:data:`MEASURED_ERROR` is the median |error| of predicted against published tokens/s per GPU
over each preset's rows, each row predicted by terms fitted on the preset's other rows (leave
one out, ``python -m bench.cluster_published --held-out``): the error a run the fit never saw
gets, and the cluster planner's tie band. The in-sample error (terms fitted on every row) is
smaller and says less.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FITS", "MEASURED_ERROR", "Fit", "efficiency_of", "fit_for"]


@dataclass(frozen=True)
class Fit:
    """A machine's fitted efficiency terms and the rows they come from."""

    peak_share: dict[str, float]  # precision -> share of the dense peak at saturation
    d_half: float  # GEMM size (tokens and width combined) at which half of it is lost
    fitted_on: str
    tp_hidden: float = 0.0  # share of TP's collectives hidden under the GEMMs

    def efficiency(self, precision: str, tokens: float, width: float) -> float:
        share = self.peak_share.get(precision, self.peak_share.get("bf16", 0.5))
        d = 1.0 / (1.0 / tokens + 1.0 / width)
        return share * d / (d + self.d_half)


# Fitted by `python -m bench.cluster_published --fit` (see the module docstring).
FITS: dict[str, Fit] = {
    "h100": Fit({"bf16": 0.874, "fp16": 0.874, "fp8": 0.591}, 512.0,
                "megatron_h100 (9 rows, bf16 assumed) and nemo_24_07 (fp8, 6 rows)", 1.0),
    "a100": Fit({"bf16": 0.841, "fp16": 0.841}, 384.0, "narayanan_2021 (10 rows)", 0.5),
}  # fmt: skip
FITS["h200"] = FITS["h100"]

# Median |error| of predicted against published tokens/s per GPU over each preset's rows, each
# held out of the fit, as `python -m bench.cluster_published --held-out` prints it with the
# terms above; None: no published rows, the error is unknown.
MEASURED_ERROR: dict[str, float | None] = {"h100": 0.071, "a100": 0.091, "h200": None,
                                            "b200": None}


def fit_for(machine_name: str) -> Fit:
    """The preset's fit; a machine of another name (a JSON file) gets the H100's, and says so
    through :func:`efficiency_of`'s source."""
    return FITS.get(machine_name, FITS["h100"])


def efficiency_of(machine_name: str, precision: str, tokens: float, width: float) -> float:
    """The achieved share of ``machine_name``'s dense ``precision`` peak for GEMMs of
    ``tokens`` x ``width`` on one GPU."""
    return fit_for(machine_name).efficiency(precision, tokens, width)
