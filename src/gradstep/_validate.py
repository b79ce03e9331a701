"""Argument checks shared by every public constructor: one wording for every error.

Each message names the parameter (prefixed by its owner, e.g. ``ZClip: alpha``) and the
allowed values. ``error`` lets a module raise its own ValueError subclass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Error = type[Exception]


def _who(owner: str, name: str) -> str:
    return f"{owner}: {name}" if owner else name


def check_positive(name: str, value: float, owner: str = "") -> float:
    """A finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_who(owner, name)} must be a positive number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{_who(owner, name)} must be a finite number > 0, got {value!r}")
    return float(value)


def check_int(
    name: str, value: int, minimum: int, owner: str = "", error: Error | None = None
) -> int:
    """An int (not a bool) >= ``minimum``; ``error`` replaces both TypeError and ValueError."""
    message = f"{_who(owner, name)} must be an int >= {minimum}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise (error or TypeError)(message)
    if value < minimum:
        raise (error or ValueError)(message)
    return value


def check_interval(name: str, value: float, high: float, closed: bool, owner: str = "") -> float:
    """A number in (0, high) or, with ``closed``, in (0, high]."""
    shown = f"(0, {high:g}{']' if closed else ')'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_who(owner, name)} must be a number in {shown}, got {value!r}")
    if not (0 < value < high or (closed and value == high)):
        raise ValueError(f"{_who(owner, name)} must be in {shown}, got {value!r}")
    return float(value)


def check_choice(
    name: str, value: str, allowed: Sequence[str], owner: str = "", error: Error = ValueError
) -> str:
    if value not in allowed:
        raise error(f"{_who(owner, name)} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def check_state_count(what: str, arg: str, saved: list, mine: list) -> None:
    if len(saved) != len(mine):
        raise ValueError(
            f"Stepper.load_state_dict: checkpoint has {len(saved)} {what}, this Stepper has "
            f"{len(mine)}; build the Stepper with the same {arg}="
        )


def check_optimizer_covers(named: Sequence[tuple[str, Any]], optimizer: Any) -> None:
    """Every trainable parameter must be stepped: the optimizer's ``zero_grad`` would never
    clear a gradient it does not own, and that stale gradient would count in every norm."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in named if id(p) not in owned]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" ... ({len(missing)} in all)" if len(missing) > 8 else ""
        )
        raise ValueError(
            f"optimizer does not hold {len(missing)} trainable parameter(s) of the model: "
            f"{shown}. Their gradients would never be cleared and would count in the clip "
            "norm; pass them to the optimizer, or set requires_grad=False on them"
        )
