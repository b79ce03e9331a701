"""What one optimizer step did: :class:`StepStats`, built in one place for taken and
skipped steps alike."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..policies.base import Decision
from .tally import Window

__all__ = ["StepStats", "step_stats"]


@dataclass
class StepStats:
    """What one optimizer step did. ``grad_norm`` is the PRE-clip global norm."""

    loss: float
    """Window mean loss: sum of per-item losses / item count, over all ranks."""
    items: int
    micro_batches: int
    grad_norm: float
    """Global norm of the normalised, unscaled gradient before clipping (nan/inf if so)."""
    clip_coef: float
    clipped: bool
    skipped: bool
    lr: float
    step: int
    """Optimizer steps taken so far (skipped steps do not count)."""
    skip_reason: str | None = None
    clip_threshold: float | None = None
    post_clip_norm: float = math.nan
    loss_scale: float | None = None
    policies: list[dict] = field(default_factory=list)
    """Per clip policy: name, threshold used, whether it acted."""
    oom_splits: int = 0
    """Halvings of the micro-batches this step needed after out-of-memory (on_oom="split")."""
    aux: dict[str, float] = field(default_factory=dict)
    """Each ``LossSum.aux`` term's mean over the window's micro-batches on every rank (not
    part of ``loss``, the item-weighted mean of the loss sums)."""


def step_stats(
    window: Window,
    norm: float,
    decision: Decision,
    *,
    lr: float,
    step: int,
    loss_scale: float | None,
    post_clip_norm: float = math.nan,
    skip_reason: str | None = None,
) -> StepStats:
    return StepStats(
        aux=window.aux,
        loss=window.loss,
        items=window.items,
        micro_batches=window.micro_batches,
        grad_norm=norm,
        clip_coef=decision.coef,
        clipped=decision.acted and skip_reason is None,
        skipped=skip_reason is not None,
        lr=lr,
        step=step,
        skip_reason=skip_reason,
        clip_threshold=decision.threshold,
        post_clip_norm=post_clip_norm,
        loss_scale=loss_scale,
        policies=decision.detail,
    )
