"""Comma-separated command-line lists (``--schedules 1f1b,zbv``, ``--sizes d_model=64``)."""

from __future__ import annotations

from collections.abc import Sequence

from vpipe.errors import VpipeError


def parse_list(text: str | Sequence[str]) -> list[str]:
    """Comma-separated CLI list (or an already split one) without blanks."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return [s.strip() for s in items if s.strip()]


def parse_sizes(text: str) -> dict[str, int]:
    """``"d_model=64,n_blocks=8"`` -> ``{"d_model": 64, "n_blocks": 8}``."""
    sizes: dict[str, int] = {}
    for item in parse_list(text):
        key, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise VpipeError(f"--sizes: expected NAME=INT items, got {item!r}")
        sizes[key.strip()] = int(value)
    return sizes
