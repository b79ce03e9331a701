"""Argument checks shared by every public constructor: one wording for every error.

Each message names the parameter (prefixed by its owner, e.g. ``ZClip: alpha`` or ``LAMB:
lr``), says what is allowed and shows what was given (``..., got X``). ``error`` lets a caller
raise one exception type for every bad value (its own ValueError subclass, or ValueError
where a wrong type is just another bad value).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

Error = type[Exception]


def _who(owner: str, name: str) -> str:
    return f"{owner}: {name}" if owner else name


def _allowed(low: float, high: float | None, above: bool, closed: bool) -> str:
    if high is None:
        return f"a finite number {'>' if above else '>='} {low:g}"
    return f"a number in {'(' if above else '['}{low:g}, {high:g}{']' if closed else ')'}"


def check_number(
    name: str,
    value: Any,
    owner: str = "",
    *,
    low: float = 0.0,
    high: float | None = None,
    above: bool = False,
    closed: bool = False,
    optional: bool = False,
    error: Error | None = None,
) -> Any:
    """A finite real number (not a bool) ``>= low`` (``> low`` with ``above``) and, when
    ``high`` is given, ``< high`` (``<= high`` with ``closed``), as a float; None too with
    ``optional``. A value of the wrong type raises TypeError, a number out of range
    ValueError; ``error`` replaces both."""
    if value is None and optional:
        return None
    allowed = _allowed(low, high, above, closed) + (" or None" if optional else "")
    message = f"{_who(owner, name)} must be {allowed}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise (error or TypeError)(message)
    in_range = value > low if above else value >= low
    if high is not None:
        in_range = in_range and (value <= high if closed else value < high)
    if not (math.isfinite(value) and in_range):
        raise (error or ValueError)(message)
    return float(value)


def check_positive(name: str, value: float, owner: str = "", error: Error | None = None) -> float:
    """A finite number > 0."""
    return check_number(name, value, owner, above=True, error=error)


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
    return check_number(name, value, owner, high=high, above=True, closed=closed)


def check_choice(
    name: str, value: str, allowed: Sequence[str], owner: str = "", error: Error = ValueError
) -> str:
    """One of ``allowed`` (names, listed in the message in their order)."""
    if value not in allowed:
        raise error(f"{_who(owner, name)} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def check_flag(name: str, value: Any, owner: str = "", optional: bool = False) -> bool | None:
    """True or False (or None, with ``optional``): a truthy string is not a flag."""
    if (value is None and optional) or isinstance(value, bool):
        return value
    allowed = "True, False or None" if optional else "True or False"
    raise TypeError(f"{_who(owner, name)} must be {allowed}, got {value!r}")


def check_params(value: Any, owner: str) -> list[Any]:
    """``params`` as ``torch.optim`` takes it (tensors, (name, tensor) pairs or group dicts),
    as a list (group dicts copied, their ``params`` as lists), refused with the owner's name
    when it holds no parameter at all."""
    if isinstance(value, (torch.Tensor, dict)):
        kind = "a Tensor" if isinstance(value, torch.Tensor) else "a dict"
        raise TypeError(
            f"{owner}: params must be an iterable of parameters or of param-group dicts, got "
            f"{kind}; pass model.parameters(), [tensor] or [group]"
        )
    groups = [dict(g) if isinstance(g, dict) else g for g in value]
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


def check_stepper_args(
    model: Any, optimizer: Any, scheduler: Any, on_oom: str, on_oom_allowed: Sequence[str],
    split_fn: Any,
) -> None:  # fmt: skip
    """The arguments of ``gradstep.Stepper`` that are not checked where they are used."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(
            "scheduler must be None or an LR scheduler with step() (e.g. "
            f"torch.optim.lr_scheduler.LambdaLR), got {type(scheduler).__name__}"
        )
    check_choice("on_oom", on_oom, on_oom_allowed)
    if split_fn is not None and not callable(split_fn):
        raise TypeError(f"split_fn must be None or a callable, got {type(split_fn).__name__}")


def check_stepper_state(state: Any, clip: list, hooks: list) -> tuple[list, list]:
    """A ``Stepper.state_dict()`` that fits this Stepper: its clip policies' and hooks'
    states, checked in number and (policies) class before anything is loaded."""
    counters = ("step_count", "skipped_steps", "clipped_steps")
    missing = [k for k in counters if k not in state] if isinstance(state, dict) else counters
    if missing:
        raise ValueError(f"Stepper.load_state_dict: not a Stepper state (missing {missing})")
    clip_states, hook_states = state.get("clip", []), state.get("hooks", [])
    check_state_count("clip policies", "clip", clip_states, clip)
    check_state_types(state.get("clip_types"), clip)
    check_state_count("hooks", "hooks", hook_states, hooks)
    return clip_states, hook_states


def check_state_count(what: str, arg: str, saved: list, mine: list) -> None:
    if len(saved) != len(mine):
        raise ValueError(
            f"Stepper.load_state_dict: checkpoint has {len(saved)} {what}, this Stepper has "
            f"{len(mine)}; build the Stepper with the same {arg}="
        )


def check_state_types(saved: Sequence[str] | None, mine: Sequence[Any]) -> None:
    """The clip policies a Stepper state was saved with are this Stepper's (by class)."""
    names = [type(p).__name__ for p in mine]
    if saved is not None and list(saved) != names:
        raise ValueError(
            f"Stepper.load_state_dict: the checkpoint's clip policies are {saved}, "
            f"this Stepper's are {names}; build the Stepper with the same clip="
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


class Fixed:
    """An attribute set once in ``__init__``: a later assignment raises instead of being
    silently ignored (what it decided, e.g. the out-of-memory splitter or where the norm
    is taken, was built from it)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = f"{owner.__name__}.{name}", f"_fixed_{name}"

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        if hasattr(obj, self.slot):
            raise AttributeError(f"{self.name} is fixed when it is built: build a new one")
        setattr(obj, self.slot, value)
