"""Argument checks of the optimizers: every message names the optimizer and the argument."""

from __future__ import annotations

import math
from typing import Any

import torch


def number(owner: str, name: str, value: Any, low: float = 0.0, high: float | None = None) -> float:
    """A finite real ``low <= value`` (and ``< high`` when given)."""
    shown = f"in [{low:g}, {high:g})" if high is not None else f">= {low:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: {name} must be a finite number {shown}, got {value!r}")
    if not math.isfinite(value) or value < low or (high is not None and value >= high):
        raise ValueError(f"{owner}: {name} must be a finite number {shown}, got {value!r}")
    return float(value)


def flag(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")
    return value


def optional_flag(owner: str, name: str, value: Any) -> bool | None:
    return None if value is None else flag(owner, name, value)


def params(owner: str, value: Any) -> list[Any]:
    """``params`` as torch.optim takes it (tensors, (name, tensor) pairs or group dicts),
    as a list, refused with the optimizer's name when it holds no parameter at all."""
    if isinstance(value, (torch.Tensor, dict)):
        kind = "a Tensor" if isinstance(value, torch.Tensor) else "a dict"
        raise TypeError(
            f"{owner}: params must be an iterable of parameters or of param-group dicts, got "
            f"{kind}; pass model.parameters(), [tensor] or [group]"
        )
    items = list(value)
    groups = [dict(g) if isinstance(g, dict) else g for g in items]
    total = 0
    for g in groups:
        if isinstance(g, dict):
            inner = g.get("params", [])
            g["params"] = [inner] if isinstance(inner, torch.Tensor) else list(inner)
            total += len(g["params"])
        else:
            total += 1
    if total == 0:
        raise ValueError(
            f"{owner}: params holds no parameter (gradstep.optim.param_groups returns [] when "
            "the model has no trainable parameter: are they all frozen?); pass the model's "
            "trainable parameters"
        )
    return groups
