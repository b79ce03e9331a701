"""Argument checks of the optimizers: every message names the optimizer and the argument."""

from __future__ import annotations

import math
from typing import Any


def number(owner: str, name: str, value: Any, low: float = 0.0, high: float | None = None) -> float:
    """A finite real ``low <= value`` (and ``< high`` when given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    shown = f"[{low:g}, {high:g})" if high is not None else f">= {low:g}"
    if not math.isfinite(value) or value < low or (high is not None and value >= high):
        raise ValueError(f"{owner}: {name} must be {'in ' if high else ''}{shown}, got {value!r}")
    return float(value)


def flag(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")
    return value


def optional_flag(owner: str, name: str, value: Any) -> bool | None:
    return None if value is None else flag(owner, name, value)
