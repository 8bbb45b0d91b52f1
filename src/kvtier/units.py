"""Parsing and printing of sizes: byte sizes (`256MiB`, `80GB`) and counts (`128k`, `1M`)."""

from __future__ import annotations

import re

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
# Token counts and context lengths: `128k` means 131072 tokens (as model cards use it)
# only when spelled with a binary suffix; we follow vLLM/llama.cpp and read k=1024 for contexts.
_COUNT_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_COUNT_UNITS_DECIMAL = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


class SizeError(ValueError):
    """A size or count that cannot be parsed, or is negative."""


def _split(text: str | int | float, what: str) -> tuple[float, str]:
    if isinstance(text, (int, float)):
        if text < 0:
            raise SizeError(f"{what} must not be negative: {text}")
        return float(text), ""
    m = _NUM.match(str(text))
    if not m:
        raise SizeError(f"cannot parse {what} {text!r} (expected e.g. 128k, 256MiB, 80GB)")
    return float(m.group(1)), m.group(2).lower()


def parse_bytes(text: str | int | float) -> int:
    """`256MiB` -> 268435456, `80GB` -> 80e9, `4096` -> 4096."""
    value, unit = _split(text, "byte size")
    if unit not in _BYTE_UNITS:
        raise SizeError(f"unknown byte unit {unit!r} in {text!r} (use B, KB, MB, GB, KiB, MiB, GiB, ...)")
    return int(round(value * _BYTE_UNITS[unit]))


def parse_count(text: str | int | float, *, binary: bool = True) -> int:
    """`128k` -> 131072 (binary, for contexts), `3M` -> 3145728; `binary=False` reads k=1000."""
    value, unit = _split(text, "count")
    units = _COUNT_UNITS if binary else _COUNT_UNITS_DECIMAL
    if unit not in units:
        raise SizeError(f"unknown count suffix {unit!r} in {text!r} (use k, M, G)")
    return int(round(value * units[unit]))


def fmt_bytes(num_bytes: float, *, binary: bool = True) -> str:
    """4.0 GiB (binary, default) or 4.3 GB (decimal); the unit is always printed."""
    step, names = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]) if binary else (
        1000.0, ["B", "KB", "MB", "GB", "TB", "PB"])
    value = float(num_bytes)
    for name in names:
        if abs(value) < step or name == names[-1]:
            return f"{value:.0f} {name}" if name == "B" else f"{value:.2f} {name}"
        value /= step
    raise AssertionError("unreachable")


def fmt_count(num: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(num) >= div:
            return f"{num / div:.1f}{unit}"
    return f"{num:.0f}"
