"""AutoClip (Seetharaman et al. 2020): clip to a percentile of the earlier norms."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from .._validate import check_int, check_interval
from .base import ClipResult, GradientView, scale_to
from .registry import register

__all__ = ["AutoClip"]


class AutoClip:
    """AutoClip (Seetharaman et al. 2020): clip to a percentile of the earlier norms.

    threshold_t = ``percentile``-th percentile (linear interpolation, as
    ``numpy.percentile``) of the pre-clip global norms of the previous ``history`` steps;
    the first step has no history and is not clipped. The current norm joins the history
    after the decision, pre-clip as in the paper.
    """

    def __init__(self, percentile: float = 10.0, history: int = 1000) -> None:
        self.percentile = check_interval("percentile", percentile, 100, True, "AutoClip")
        self.history = check_int("history", history, 1, "AutoClip")
        self._norms: deque[float] = deque(maxlen=self.history)

    def __repr__(self) -> str:
        return f"AutoClip(percentile={self.percentile}, history={self.history})"

    def clip(self, ctx: GradientView) -> ClipResult:
        norm = ctx.total_norm(2.0)  # the papers use the L2 norm, whatever ClipNorm uses
        threshold = (
            float(np.percentile(np.fromiter(self._norms, np.float64), self.percentile))
            if self._norms
            else None
        )
        self._norms.append(norm)
        return scale_to(norm, threshold)

    def state_dict(self) -> dict[str, Any]:
        return {"norms": list(self._norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._norms = deque((float(x) for x in state["norms"]), maxlen=self.history)


register(
    "autoclip",
    AutoClip,
    lambda v: AutoClip() if v is None else AutoClip(v),
    arg="P",
    help="AutoClip(percentile=P), default 10",
    order=40,
)
