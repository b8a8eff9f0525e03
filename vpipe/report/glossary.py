"""The words vpipe's tables, verdicts and flags share, each with one meaning, and the labels
the report's setup table gives the sweep's recorded options.

"Blocks" is the word most at risk: a sweep's blocks are launches of its ranks (``--blocks``),
while a model's ``n_blocks`` are its layers. The setup table keeps the model's word (it is what
``--sizes`` takes) and says which one a row means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GLOSSARY: dict[str, str] = {
    "step": "one training step of the whole pipeline: every microbatch's forward and backward "
    "on every rank; its time is the slowest rank's",
    "steps": "timed steps per config in each round (--steps)",
    "round": "one pass over every config of a sweep, each timing its steps in turn; configs "
    "alternate round by round, so whatever the host does hits them all",
    "block": "one launch of the ranks running every config's rounds (--blocks); several "
    "blocks measure launch-to-launch variance (not the model's n_blocks, its layers)",
    "pair": "two figures measured back to back and compared: within a sweep, two configs' "
    "steps of the same round and step index; in vpipe ab, A's launch and B's adjacent one, "
    "compared round by round where both were open at once",
    "saved activations": "bytes of tensors saved for backward, the most live at once on a "
    "rank (all that CPU runs measure)",
    "allocator peak": "the most bytes torch's CUDA caching allocator held at once on a rank "
    "(measured on GPUs only)",
}

# The setup table's label and meaning of a recorded sweep option (its meta.json name)
SETUP: dict[str, tuple[str, str]] = {
    "steps": ("steps per round (--steps)", GLOSSARY["steps"]),
    "rounds": ("rounds asked (--rounds)", "rounds every config runs before any is added"),
    "rounds_run": ("rounds run", "rounds that ran, all blocks together, those the time "
                   "budget added included"),  # fmt: skip
    "rounds_stop": ("rounds ended", "fixed: as asked; decided: no order left open and every "
                    "median known to --timing-precision; budget: --max-minutes ran out"),  # fmt: skip
    "cpu_allocator": ("CPU allocator (--cpu-allocator)", "cached: each rank's malloc keeps the "
                      "memory a step frees, as a GPU's caching allocator does; system: the C "
                      "library's defaults"),  # fmt: skip
    "timing_precision": ("median precision asked (--timing-precision)", "rounds were added "
                         "until every config's median step time was known to +- this many "
                         "percent (95%), within --max-minutes; 0: not asked"),  # fmt: skip
    "blocks": ("blocks (--blocks)", GLOSSARY["block"]),
    "model_sizes": ("model sizes built", "n_blocks grown to the largest stage count; "
                    "n_blocks: the model's layers, not launch blocks"),  # fmt: skip
    "sizes": ("model sizes (--sizes)", "n_blocks: the model's layers, not launch blocks"),
    "profile_steps": ("profiled steps (--profile-steps)", "steps recorded under "
                      "torch.profiler, one per round; calibration reads them"),  # fmt: skip
}

# What a sweep option recorded as null means (the flag was not given)
WHEN_UNSET: dict[str, str] = {
    "dtype": "default: bf16 on cuda, fp32 on cpu",
    "post_thread": "default: on with gloo, off otherwise",
    "backend": "default: gloo on cpu, nccl on cuda",
    "commit": "unknown: vpipe did not run from a git checkout",
}


def setup_rows(meta: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """The setup table's rows: (label, value, meaning) per recorded option, an unset one
    shown as what it defaulted to."""
    rows = []
    for key, value in meta.items():
        label, means = SETUP.get(key, (key, ""))
        if value is None and key in WHEN_UNSET:
            value = WHEN_UNSET[key]
        rows.append((label, value, means))
    return rows
