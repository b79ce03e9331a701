"""Validation loss of a run: the training loss's definition, over the validation batches.

A validation batch that runs out of memory is split in halves and run again (on several
ranks every rank splits together, as the Stepper's windows do): a run whose training
recovered from out-of-memory must not crash in its evaluation at the planned size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradstep import LossSum, parallel, token_loss
from gradstep.step import (
    MAX_HALVINGS,
    ON_OOM,
    OOMAgreement,
    SplitFn,
    WindowOOM,
    halve,
    split_in_half,
    too_large_error,
)
from gradstep_cli.data.sources import Batch

__all__ = ["LMLoss", "evaluate"]


@dataclass(frozen=True)
class LMLoss:
    """``loss_fn`` for the Stepper: summed next-byte cross-entropy and its token count."""

    device: torch.device

    def __call__(self, model: nn.Module, batch: Batch) -> LossSum:
        logits = model(batch["input_ids"].to(self.device, non_blocking=True))
        return token_loss(logits, batch["labels"].to(self.device, non_blocking=True))


def _sums(
    model: nn.Module,
    parts: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], LossSum],
    device: torch.device,
    agreement: OOMAgreement | None,
) -> torch.Tensor:
    """(loss sum, token count) of ``parts`` in float64; with ``agreement``, an
    out-of-memory in any part (on any rank) raises WindowOOM on every rank."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for part in parts:
        guard = agreement.guard(part) if agreement is not None else contextlib.nullcontext()
        with guard:
            loss = loss_fn(model, part)  # only the token-weighted term: aux terms stay out
            total, count = loss.total, loss.count
            sums += torch.stack([total.double(), torch.as_tensor(count, device=device).double()])
    return sums


def _batch_sums(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], LossSum],
    device: torch.device,
    agreement: OOMAgreement,
    state: dict[str, int],
    split_fn: SplitFn,
) -> torch.Tensor:
    """One batch, halved ``state["halvings"]`` times, and again after out-of-memory."""
    while True:
        agreement.reset()
        parts = halve([batch], split_fn, state["halvings"])
        try:
            return _sums(model, parts, loss_fn, device, agreement)
        except WindowOOM:
            if agreement.stuck() or state["halvings"] >= MAX_HALVINGS:
                raise too_large_error(state["halvings"], agreement.last_error) from None
            state["halvings"] += 1  # later batches start split too


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Sequence[Batch],
    device: torch.device,
    loss_fn: Callable[[nn.Module, Batch], LossSum] | None = None,
    *,
    on_oom: str = "split",
    split_fn: SplitFn | None = None,
) -> float:
    """Token-weighted mean loss (sum of token losses / token count), summed over ranks.

    The same definition as the training loss, so the two curves are comparable; a mean of
    per-batch means would over-weight short batches. ``on_oom="split"`` (default): a batch
    that runs out of memory is cut in halves (``split_fn``, default the Stepper's) until it
    fits, later batches starting at that size; the sums, and so the result, are those of
    the unsplit batches (to float rounding). On several ranks every rank must pass the same
    number of batches (FSDP2's forwards all-gather), and all split together.
    """
    if on_oom not in ON_OOM:
        raise ValueError(f"on_oom must be one of {', '.join(ON_OOM)}; got {on_oom!r}")
    was_training = model.training
    model.eval()
    loss_fn = loss_fn or LMLoss(device)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        if on_oom == "raise":
            sums += _sums(model, batches, loss_fn, device, None)
        else:
            sums += _split_sums(model, batches, loss_fn, device, split_fn or split_in_half)
    finally:
        model.train(was_training)
    total, count = parallel.all_reduce_sum(sums).tolist()
    return total / count if count else math.nan


def _split_sums(
    model: nn.Module,
    batches: Sequence[Batch],
    loss_fn: Callable[[nn.Module, Batch], LossSum],
    device: torch.device,
    split_fn: SplitFn,
) -> torch.Tensor:
    strategy = parallel.strategy_for(model)
    caps = parallel.capabilities(strategy)
    agreement = OOMAgreement(caps.agree_sum, caps.agree_ranks)
    modules = caps.communicating_modules() if strategy.world_size > 1 else []
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    state = {"halvings": 0}
    with agreement.before_forwards(modules):
        for batch in batches:
            sums += _batch_sums(model, batch, loss_fn, device, agreement, state, split_fn)
    return sums
