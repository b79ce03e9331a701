"""Spec strings (``"zclip:3"``) to policy lists: the grammar behind ``--clip``.

It imports every policy and is imported by none of them, so the policies never depend on
how a command line names them.
"""

from __future__ import annotations

from torch import nn

from .agc import AGC, find_output_layer
from .base import ClipPolicy
from .registry import registered, spec_grammar
from .spike_guard import SpikeGuard

__all__ = ["clip_policies", "parse_clip", "spec_help"]


def spec_help() -> str:
    """One line per named policy, for a command line's ``--help``."""
    lines = [f"{s.grammar}: {s.help}" for s in registered().values()]
    return "none: no clipping; " + "; ".join(lines)


def parse_clip(spec: str) -> ClipPolicy | None:
    """Parse a clip spec into one policy (or None for ``"none"``).

    The forms are those of the registry (:func:`gradstep.policies.register`): ``none``;
    ``norm[:MAX]`` (ClipNorm, default 1.0); ``value:V`` (ClipValue); ``zclip[:Z]``;
    ``autoclip[:P]``; ``agc[:LAMBDA]`` (excluding nothing: :func:`clip_policies` with a
    model excludes its output layer).
    """
    grammar = spec_grammar()
    if not isinstance(spec, str):
        raise TypeError(f"--clip must be a string ({grammar}); got {spec!r}")
    name, sep, arg = spec.strip().partition(":")
    name = name.lower()
    if name == "none" and not sep:
        return None
    policies = registered()
    if name not in policies:
        raise ValueError(f"--clip must be one of {grammar}; got {spec!r}")
    entry = policies[name]
    if entry.required and not arg:
        raise ValueError(f"--clip {spec!r}: {name} needs a number, e.g. {name}:0.5")
    try:
        return entry.make(float(arg) if arg else None)
    except ValueError as exc:
        raise ValueError(f"--clip {spec!r}: {exc}") from exc


def clip_policies(
    spec: str, spike_guard: bool = False, model: nn.Module | None = None
) -> list[ClipPolicy]:
    """The policy list of ``--clip SPEC [--spike-guard]``, in the order they apply.

    ``--spike-guard`` puts a default :class:`SpikeGuard` first, so a skipped spike never
    reaches the statistics of the clip after it. With ``model`` given, ``agc`` excludes the
    model's output layer (:func:`find_output_layer`), as the paper does.
    """
    policy = parse_clip(spec)
    if isinstance(policy, AGC) and model is not None:
        policy = AGC(policy.clipping, policy.eps, exclude=find_output_layer(model))
    return [*([SpikeGuard()] if spike_guard else []), *([policy] if policy is not None else [])]
