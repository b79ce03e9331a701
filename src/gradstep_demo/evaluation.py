"""Validation loss of the demo: the training loss's definition, over the validation batches."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gradstep import LossSum, parallel, token_loss

from .data import Batch

__all__ = ["LMLoss", "evaluate"]


@dataclass(frozen=True)
class LMLoss:
    """``loss_fn`` for the Stepper: summed next-byte cross-entropy and its token count."""

    device: torch.device

    def __call__(self, model: nn.Module, batch: Batch) -> LossSum:
        logits = model(batch["input_ids"].to(self.device, non_blocking=True))
        return token_loss(logits, batch["labels"].to(self.device, non_blocking=True))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Sequence[Batch],
    device: torch.device,
    loss_fn: Callable[[nn.Module, Batch], LossSum] | None = None,
) -> float:
    """Token-weighted mean loss (sum of token losses / token count), summed over ranks.

    The same definition as the training loss, so the two curves are comparable; a mean of
    per-batch means would over-weight short batches.
    """
    was_training = model.training
    model.eval()
    loss_fn = loss_fn or LMLoss(device)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        loss = loss_fn(model, batch)  # only the token-weighted term: aux terms stay out
        total, count = loss.total, loss.count
        sums += torch.stack([total.double(), torch.as_tensor(count, device=device).double()])
    model.train(was_training)
    total, count = parallel.all_reduce_sum(sums).tolist()
    return total / count if count else math.nan
