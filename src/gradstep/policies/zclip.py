"""ZClip (Kumar et al. 2025, arXiv 2504.02507): z-score clipping on EMA statistics."""

from __future__ import annotations

import math
from typing import Any

from .._validate import check_choice, check_int, check_interval, check_number, check_positive
from .base import ClipResult, GradientView, scale_to
from .registry import register

__all__ = ["ZCLIP_MODES", "ZClip"]

ZCLIP_MODES = ("zscore", "mean", "percentile")


class ZClip:
    """ZClip (Kumar et al. 2025, arXiv 2504.02507): z-score clipping on EMA statistics.

    The first ``warmup_steps`` norms only initialise the mean and (population) variance;
    no adaptive clip then. Afterwards, with z = (g - mean) / (std + 1e-6) and z_t =
    ``z_thresh``, a norm with z > z_t is scaled down to

    * ``mode="zscore"``: mean + z_t^2 / z * std (the paper's reciprocal threshold),
    * ``mode="mean"``: mean,
    * ``mode="percentile"``: mean + z_t * std,

    and the EMA is updated with the CLIPPED value g*: mean <- a*mean + (1-a)*g*,
    var <- a*var + (1-a)*(g* - mean)^2 with the new mean (a = ``alpha``), so a spike
    does not inflate the statistics. ``max_grad_norm``, when set, is an absolute cap on top
    (warm-up included); it does not enter the statistics. The reported threshold is the
    norm clipped to when acting, otherwise the level above which it would act.
    """

    EPS = 1e-6

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        warmup_steps: int = 25,
        mode: str = "zscore",
        max_grad_norm: float | None = None,
    ) -> None:
        self.alpha = check_interval("alpha", alpha, 1, False, "ZClip")
        self.z_thresh = check_positive("z_thresh", z_thresh, "ZClip")
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1, "ZClip")
        self.mode = check_choice("mode", mode, ZCLIP_MODES, "ZClip")
        self.max_grad_norm: float | None = check_number(
            "max_grad_norm", max_grad_norm, "ZClip", above=True, optional=True
        )
        self._warmup: list[float] = []
        self.mean: float | None = None
        self.var: float | None = None

    def __repr__(self) -> str:
        return (
            f"ZClip(alpha={self.alpha}, z_thresh={self.z_thresh}, "
            f"warmup_steps={self.warmup_steps}, mode={self.mode!r}, "
            f"max_grad_norm={self.max_grad_norm})"
        )

    def clip(self, ctx: GradientView) -> ClipResult:
        g = ctx.total_norm(2.0)
        if self.mean is None or self.var is None:
            self._warmup.append(g)
            if len(self._warmup) >= self.warmup_steps:
                self.mean = sum(self._warmup) / len(self._warmup)
                self.var = sum((x - self.mean) ** 2 for x in self._warmup) / len(self._warmup)
                self._warmup = []
            return scale_to(g, self.max_grad_norm)
        target, boundary = self._target(g, self.mean, self.var)
        g_star = g if target is None else min(g, target)
        self.mean = self.alpha * self.mean + (1 - self.alpha) * g_star
        self.var = self.alpha * self.var + (1 - self.alpha) * (g_star - self.mean) ** 2
        result = scale_to(g, _min(target, self.max_grad_norm))
        if not result.acted:
            result.threshold = _min(boundary, self.max_grad_norm)
        return result

    def _target(self, g: float, mean: float, var: float) -> tuple[float | None, float]:
        """(norm to clip to or None, the norm above which z > z_thresh)."""
        std = math.sqrt(var)
        z = (g - mean) / (std + self.EPS)
        boundary = mean + self.z_thresh * (std + self.EPS)
        if not z > self.z_thresh:
            return None, boundary
        if self.mode == "zscore":
            return mean + self.z_thresh**2 / z * std, boundary
        if self.mode == "mean":
            return mean, boundary
        return mean + self.z_thresh * std, boundary

    def state_dict(self) -> dict[str, Any]:
        return {"warmup": list(self._warmup), "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._warmup = [float(x) for x in state["warmup"]]
        self.mean = None if state["mean"] is None else float(state["mean"])
        self.var = None if state["var"] is None else float(state["var"])


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


register(
    "zclip",
    ZClip,
    lambda v: ZClip() if v is None else ZClip(z_thresh=v),
    arg="Z",
    help="ZClip(z_thresh=Z), default 2.5",
    order=30,
)
