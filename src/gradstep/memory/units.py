"""Byte counts as people write them: ``parse_size("1.5GiB")`` and ``format_bytes(n)``.

Decimal units (KB, MB, GB, TB: powers of 1000) and binary units (KiB, MiB, GiB, TiB: powers
of 1024) are both accepted because both appear in the wild (``nvidia-smi`` prints MiB, cloud
instance sheets print GB) and a budget silently off by 7% (GB vs GiB) is exactly the margin a
plan is computed with. A bare number is refused: ``--memory-budget 8`` could mean 8 GB or
8 bytes, and guessing wrong either wastes the machine or fails much later.
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_size"]

_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_ALLOWED = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)\s*$")
_EXPONENT = re.compile(r"^\s*[\d.]+[eE][+-]?\d+\s*[A-Za-z]*\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` such as ``"1.5GiB"``, ``"800 MB"``, ``"512kib"`` (case-insensitive).

    An ``int`` is taken as bytes already (what a caller holding a number means). Raises a
    ValueError naming the memory budget and the allowed units for anything else, and for
    sizes that round to 0 bytes (a budget nothing can fit in).
    """
    if isinstance(text, bool):
        raise ValueError(f"memory budget must be a size such as '8GiB', got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"memory budget must be > 0 bytes, got {text}")
        return text
    match = _SIZE.match(text) if isinstance(text, str) else None
    if match is None and isinstance(text, str) and _EXPONENT.match(text):
        raise ValueError(
            f"memory budget {text!r}: exponents are not accepted; write the number out with "
            f"a unit, e.g. '8GiB' or '1.5GB'; units: {_ALLOWED}"
        )
    if match is None:
        raise ValueError(
            f"memory budget {text!r} is not a size: write a number and a unit, e.g. '8GiB' "
            f"or '1.5GB'; units: {_ALLOWED}"
        )
    number, unit = match.groups()
    mult = _UNITS.get(unit.lower())
    if mult is None:
        raise ValueError(f"memory budget {text!r}: unknown unit {unit!r}; units: {_ALLOWED}")
    value = round(float(number) * mult)
    if value <= 0:
        raise ValueError(f"memory budget {text!r} is 0 bytes; units: {_ALLOWED}")
    return value


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units with two decimals: ``"1.50 GiB"``, ``"512 B"``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{sign}{n:.2f} {unit}"
