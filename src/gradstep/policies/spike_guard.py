"""Skip the whole update on an outlier loss or gradient norm (OLMo-core's skip step)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from .._validate import check_choice, check_int, check_positive
from .base import ClipResult, GradientView
from .registry import register

__all__ = ["SPIKE_SIGNALS", "SpikeGuard"]

SPIKE_SIGNALS = ("grad_norm", "loss", "both")


class SpikeGuard:
    """Skip the whole update when the loss or grad norm spikes (OLMo-core's skip step).

    A value x is a spike when x - mean > ``sigma`` * std, where mean and std (sample
    standard deviation) are taken over the previous ``window`` steps; the guard is active
    once it has seen ``min_steps`` of them. ``on`` picks the signal: ``"grad_norm"``
    (``ctx.norm``, global and pre-clip when the guard comes first), ``"loss"`` (the
    window's mean loss) or ``"both"`` (either spikes). Every finite value joins the
    window, skipped ones too, as in OLMo-core: a lasting shift in level therefore stops
    being skipped once the window has absorbed it, instead of skipping forever.

    A skip leaves parameters, optimizer and scheduler untouched; the Stepper is the record:
    it counts the skip in ``Stepper.skipped_steps`` / ``skip_reasons`` and reports the
    reason in ``StepStats.skip_reason``.
    The reported threshold is mean + sigma * std of the grad norm (of the loss when
    ``on="loss"``), None before the guard is active.
    """

    def __init__(
        self, sigma: float = 6.0, window: int = 128, min_steps: int = 64, on: str = "grad_norm"
    ) -> None:
        self.sigma = check_positive("sigma", sigma, "SpikeGuard")
        self.window = check_int("window", window, 2, "SpikeGuard")
        self.min_steps = check_int("min_steps", min_steps, 2, "SpikeGuard")
        if self.min_steps > self.window:
            raise ValueError(
                f"SpikeGuard: min_steps must be <= window ({self.window}), got {min_steps!r}"
            )
        self.on = check_choice("on", on, SPIKE_SIGNALS, "SpikeGuard")
        self._history: dict[str, deque[float]] = {
            key: deque(maxlen=self.window) for key in ("grad_norm", "loss")
        }

    def __repr__(self) -> str:
        return (
            f"SpikeGuard(sigma={self.sigma}, window={self.window}, "
            f"min_steps={self.min_steps}, on={self.on!r})"
        )

    def clip(self, ctx: GradientView) -> ClipResult:
        signals = ("grad_norm", "loss") if self.on == "both" else (self.on,)
        values = {"grad_norm": ctx.total_norm(2.0), "loss": float(ctx.loss)}
        spikes, threshold = [], None
        for key in signals:
            limit = self._limit(self._history[key])
            if limit is not None and values[key] > limit:
                spikes.append(key)
            if threshold is None:
                threshold = limit
        for key in signals:
            if math.isfinite(values[key]):
                self._history[key].append(values[key])
        if not spikes:
            return ClipResult(threshold=threshold)
        reason = (
            f"SpikeGuard: {' and '.join(spikes)} spike (> mean + {self.sigma:g} sigma of the "
            f"last {self.window} steps)"
        )
        return ClipResult(threshold=threshold, acted=True, skip=reason)

    def _limit(self, history: deque[float]) -> float | None:
        if len(history) < self.min_steps:
            return None
        values = np.fromiter(history, np.float64)
        return float(values.mean() + self.sigma * values.std(ddof=1))

    def state_dict(self) -> dict[str, Any]:
        return {
            "grad_norm": list(self._history["grad_norm"]),
            "loss": list(self._history["loss"]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("grad_norm", "loss"):
            self._history[key] = deque((float(x) for x in state[key]), maxlen=self.window)


register("", SpikeGuard)  # a policy without a spec name: --spike-guard is its own flag
