"""Everything that decides on the gradient once its global norm is known.

- :mod:`.base`: the contract (:class:`ClipPolicy`, :class:`GradientView`, :class:`ClipResult`);
- one file per policy: :mod:`.fixed` (ClipNorm, ClipValue), :mod:`.agc`, :mod:`.autoclip`,
  :mod:`.zclip`, :mod:`.spike_guard`;
- :mod:`.registry`: short names, from which the spec grammar and error texts are made;
- :mod:`.spec`: spec strings (``"zclip:3"``) to policies, for command lines.

Adding a policy: a file here with the class and one :func:`register` call, and its import
below (see ``docs/extending.md``).
"""

from __future__ import annotations

from typing import Any

from .agc import AGC, find_output_layer
from .autoclip import AutoClip
from .base import ClipPolicy, ClipResult, GradientView
from .fixed import ClipNorm, ClipValue
from .registry import PolicySpec, policy_classes, register, registered, spec_grammar
from .spec import clip_policies, parse_clip, spec_help
from .spike_guard import SpikeGuard
from .zclip import ZClip

__all__ = [
    "AGC",
    "AutoClip",
    "ClipNorm",
    "ClipPolicy",
    "ClipResult",
    "ClipValue",
    "GradientView",
    "PolicySpec",
    "SpikeGuard",
    "ZClip",
    "as_policies",
    "clip_policies",
    "find_output_layer",
    "parse_clip",
    "policy_classes",
    "register",
    "registered",
    "spec_grammar",
    "spec_help",
]


def as_policies(clip: Any) -> list[ClipPolicy]:
    """Normalise a ``clip=`` argument: None, one policy, or a list applied in order."""
    if clip is None:
        return []
    items = list(clip) if isinstance(clip, (list, tuple)) else [clip]
    for item in items:
        if isinstance(item, type) or not isinstance(item, ClipPolicy):
            names = ", ".join(f"gradstep.{c.__name__}" for c in policy_classes())
            what = f"the class {item.__name__}" if isinstance(item, type) else type(item).__name__
            raise TypeError(
                f"clip must be None, a clip policy instance ({names}, or any object with "
                f"clip(view) -> ClipResult) or a list of them; got {what}"
            )
    return items
