"""Byte units: their formatting for logs and tables and the sizes users write (``24GiB``, ``80%``), shared by every
layer (models, tiers, engine, server, CLI)."""

from __future__ import annotations

import re

from moetier.errors import ConfigError

GiB = 1 << 30


def gib(nbytes: float) -> str:
    """Bytes as GiB: two decimals, or six decimals below 0.01 GiB (tiny test models)."""
    value = nbytes / GiB
    return f"{value:.2f}" if value >= 0.01 or value == 0 else f"{value:.6f}"


_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z%]*)\s*$")


def parse_size(value: str | int, what: str = "size", total: int | None = None) -> int:
    """Bytes from ``24GiB``, ``24GB`` (decimal), ``512MiB``, a plain byte count, or ``80%`` of ``total``.

    Raises a one-line :class:`ConfigError` naming ``what`` for anything else (``24G`` is ambiguous:
    say GiB or GB).
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a size like 24GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what} must not be negative, got {value}")
        return value
    match = _SIZE.match(str(value))
    if match is None:
        raise ConfigError(f"{what}: cannot read {value!r}; write a size like 24GiB, 24GB, 512MiB or 80%")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if total is None:
            raise ConfigError(f"{what}: {value!r} is a percentage, but the device's memory is unknown; give GiB")
        if not 0 < number <= 100:
            raise ConfigError(f"{what}: a percentage must be in (0, 100], got {value!r}")
        return int(total * number / 100)
    if unit == "" and number.is_integer():
        return int(number)
    if unit not in _UNITS:
        raise ConfigError(f"{what}: unknown unit {match.group(2)!r} in {value!r}; use B, KB, MB, GB, KiB, MiB or GiB")
    return int(number * _UNITS[unit])
