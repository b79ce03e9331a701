"""Learning-rate scaling with the batch size.

When the batch changes (a batch-size ramp, more ranks), the learning rate tuned for one
batch no longer fits: SGD keeps the same update per item with the linear rule (Goyal et
al. 2017), Adam-type optimizers keep the gradient noise per update with the square-root
rule (Malladi et al. 2022, OLMo-core's batch-size warm-up). Which holds for a given run is
an empirical question; ``"none"`` keeps the learning rate as it is.
"""

from __future__ import annotations

import math

from ._validate import check_choice, check_number, check_positive

__all__ = ["LR_SCALING", "scale_lr"]

LR_SCALING = ("none", "linear", "sqrt")


def scale_lr(lr: float, batch: float, base_batch: float, rule: str) -> float:
    """``lr`` (tuned for ``base_batch``) for a step of ``batch``: ``rule`` is one of
    ``none`` (unchanged), ``linear`` (x batch/base_batch), ``sqrt`` (x sqrt(batch/base_batch)).

    ``batch`` and ``base_batch`` are in the same unit (items, sequences or micro-batches);
    ``lr`` must be a finite number >= 0.
    """
    check_choice("rule", rule, LR_SCALING, "scale_lr")
    check_positive("batch", batch, "scale_lr")
    check_positive("base_batch", base_batch, "scale_lr")
    # A negative rate is a step up the loss; scaling it would only make that step larger.
    check_number("lr", lr, "scale_lr", error=ValueError)
    ratio = batch / base_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    return float(lr)
