"""Fixed-threshold clipping: the global norm (``ClipNorm``) and each element (``ClipValue``)."""

from __future__ import annotations

import math

import torch

from .._validate import check_positive
from .base import ClipResult, GradientView, check_norm_type
from .registry import register

__all__ = ["ClipNorm", "ClipValue"]


class ClipNorm:
    """Scale the whole gradient so that its global norm is at most ``max_norm``.

    coef = min(1, max_norm / (norm + 1e-6)), the formula of ``torch.nn.utils.clip_grad_norm_``,
    applied to the global norm over every rank and shard.
    """

    def __init__(self, max_norm: float = 1.0, norm_type: float = 2.0) -> None:
        self.max_norm = check_positive("max_norm", max_norm, "ClipNorm")
        self.norm_type = check_norm_type(norm_type, "ClipNorm")

    def __repr__(self) -> str:
        return f"ClipNorm(max_norm={self.max_norm}, norm_type={self.norm_type})"

    def clip(self, ctx: GradientView) -> ClipResult:
        norm = ctx.total_norm(self.norm_type)
        coef = min(1.0, self.max_norm / (norm + 1e-6))
        return ClipResult(coef=coef, threshold=self.max_norm, acted=coef < 1.0)


class ClipValue:
    """Clamp every gradient element to [-value, value] (after normalisation and unscale)."""

    def __init__(self, value: float) -> None:
        self.value = check_positive("value", value, "ClipValue")

    def __repr__(self) -> str:
        return f"ClipValue(value={self.value})"

    def clip(self, ctx: GradientView) -> ClipResult:
        grads = ctx.grads()
        # The global max |g| (every rank and shard must agree whether to act), so an
        # untouched gradient is reported as not clipped.
        peak = ctx.total_norm(math.inf)
        if peak <= self.value:
            return ClipResult(threshold=self.value)
        torch._foreach_clamp_min_(grads, -self.value)
        torch._foreach_clamp_max_(grads, self.value)
        return ClipResult(threshold=self.value, acted=True)


register(
    "norm",
    ClipNorm,
    lambda v: ClipNorm(1.0 if v is None else v),
    arg="MAX",
    help="ClipNorm(max_norm=MAX), default 1.0",
    order=10,
)
register("value", ClipValue, ClipValue, arg="V", required=True, help="ClipValue(value=V)", order=20)
