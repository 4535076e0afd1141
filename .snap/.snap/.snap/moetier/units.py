"""Byte units and their formatting for logs and tables, shared by every layer (models, tiers, engine)."""

from __future__ import annotations

GiB = 1 << 30


def gib(nbytes: float) -> str:
    """Bytes as GiB: two decimals, or six decimals below 0.01 GiB (tiny test models)."""
    value = nbytes / GiB
    return f"{value:.2f}" if value >= 0.01 or value == 0 else f"{value:.6f}"
