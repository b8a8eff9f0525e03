"""vpipe's runtime knobs of a sweep (its meta.json), and which differ between sweeps, for
``vpipe report A B``: a comparison of two knob settings should say which knobs it compares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# meta.json key -> the flag that sets it (vpipe bench --help)
KNOBS = {
    "recv_lookahead": "--recv-lookahead",
    "bundle_messages": "--no-bundle",
    "post_thread": "--post-thread",
    "recompute": "--recompute",
    "cpu_allocator": "--cpu-allocator",
}
# What a sweep from before a knob existed ran with: the C library's malloc
UNRECORDED = {"cpu_allocator": "system"}


def knob_text(meta: Mapping | None) -> str:
    """``recv_lookahead=1 bundle_messages=True post_thread=None``; empty when not recorded."""
    if not meta:
        return ""
    return " ".join(f"{k}={meta[k]}" for k in KNOBS if k in meta)


def knob_differences(metas: Sequence[Mapping | None], labels: Sequence[str]) -> list[str]:
    """In words, each knob whose value in a sweep differs from the first sweep's:
    ``recv_lookahead (--recv-lookahead): 1 in A, 2 in B``."""
    out = []
    for key, flag in KNOBS.items():
        values = [(m or {}).get(key, UNRECORDED.get(key, "not recorded")) for m in metas]
        if any(v != values[0] for v in values[1:]) and values[0] != "not recorded":
            where = ", ".join(f"{v} in {label}" for v, label in zip(values, labels, strict=True))
            out.append(f"{key} ({flag}): {where}")
    return out
