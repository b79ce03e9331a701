"""Validation of a run: the training loss's definition, over the whole validation set.

:func:`evaluate_metrics` scores every validation micro-batch once (the whole set unless
``--eval-batches N`` asks for a sample) and returns an :class:`Evaluation`: the token-weighted
loss, the token accuracy (argmax == target), the mean token entropy, and how many target
tokens (``items``) and sequences (``records``) were scored; ``metrics.jsonl`` carries them as
``val_loss``, ``val_accuracy``, ``val_entropy``, ``val_items`` and ``val_records``.
:func:`evaluate` is its loss alone, through any ``loss_fn``.

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
from gradstep.hf import chunkable, forward_hidden
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
from gradstep_cli.data.packed import row_kwargs
from gradstep_cli.data.sources import IGNORE_INDEX, Batch

__all__ = ["Evaluation", "LMLoss", "Logits", "evaluate", "evaluate_metrics", "sample_note"]

_ROWS = 2048  # target positions scored at a time: the float32 log-softmax of a chunk only
_SUMS = ("loss", "items", "correct", "entropy", "records")


@dataclass(frozen=True)
class LMLoss:
    """``loss_fn`` for the Stepper: summed next-byte cross-entropy and its token count."""

    device: torch.device

    def __call__(self, model: nn.Module, batch: Batch) -> LossSum:
        ids = batch["input_ids"].to(self.device, non_blocking=True)
        logits = model(ids, **row_kwargs(batch, self.device))
        return token_loss(logits, batch["labels"].to(self.device, non_blocking=True))


@dataclass(frozen=True)
class Logits:
    """The logits of a run's batch: the demo GPT's ``model(ids)``, or an HF model's
    ``model(input_ids=ids).logits`` (right padding, pre-shifted labels: as its loss).

    ``chunk_tokens=N`` (``--loss-chunk-tokens``): :meth:`hidden` gives the output
    projection's input and the projection, which :func:`token_sums` applies N target
    positions at a time, so evaluation never holds a micro-batch's whole logits either
    (an HF head :func:`gradstep.hf.chunkable` refuses: the whole logits, as in training)."""

    device: torch.device
    hf: bool = False
    chunk_tokens: int = 0

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        ids = batch["input_ids"].to(self.device, non_blocking=True)
        return model(input_ids=ids, use_cache=False).logits if self.hf else model(ids)

    def hidden(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, nn.Module] | None:
        """(hidden states, output projection) of ``batch``, or None: use the logits."""
        if not self.chunk_tokens or (self.hf and chunkable(model) is not None):
            return None
        ids = batch["input_ids"].to(self.device, non_blocking=True)
        if self.hf:
            return forward_hidden(model, {"input_ids": ids})
        # The head as the forward left it: under FSDP2 the root's parameters stay gathered.
        return model(ids, hidden=True), parallel.unwrap(model).lm_head


@dataclass(frozen=True)
class Evaluation:
    """One evaluation, summed over every rank."""

    loss: float
    """Token-weighted mean cross-entropy (nan when nothing was scored)."""
    accuracy: float
    """Share of target tokens whose argmax prediction is the target."""
    entropy: float
    """Mean entropy (nats) of the predicted distribution at the target positions."""
    items: int
    """Target tokens scored."""
    records: int
    """Sequences scored (a record, or a document's span), each with a target."""

    def metrics(self) -> dict[str, float | int]:
        """The metrics.jsonl fields of this evaluation."""
        return {
            "val_loss": self.loss,
            "val_accuracy": self.accuracy,
            "val_entropy": self.entropy,
            "val_items": self.items,
            "val_records": self.records,
        }

    def describe(self) -> str:
        """``val_loss 4.4787 val_accuracy 0.2531 (61 records, 3,246 tokens)``."""
        return (
            f"val_loss {self.loss:.4f} val_accuracy {self.accuracy:.4f} "
            f"({self.records:,} records, {self.items:,} tokens)"
        )

    @classmethod
    def of(cls, sums: torch.Tensor) -> Evaluation:
        loss, items, correct, entropy, records = sums.tolist()
        per = (lambda x: x / items) if items else (lambda x: math.nan)
        return cls(per(loss), per(correct), per(entropy), int(items), int(records))


def token_sums(
    logits: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Module | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """(loss sum, targets, correct, entropy sum, sequences) of one batch, in float64.

    Only the target positions are scored, ``chunk_tokens`` (default 2048) at a time in
    float32 (as the training loss): the loss is ``token_loss``'s cross-entropy. With
    ``head``, ``logits`` are the hidden states it projects, one chunk at a time."""
    labels = labels.to(logits.device)
    mask = labels != IGNORE_INDEX
    sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=logits.device)
    sums[4] = mask.any(dim=-1).sum()
    rows, targets = logits[mask], labels[mask]
    chunk_tokens = chunk_tokens or _ROWS
    for start in range(0, len(targets), chunk_tokens):
        chunk, target = rows[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        _score(chunk if head is None else head(chunk), target, sums)
    return sums


def _score(logits: torch.Tensor, target: torch.Tensor, sums: torch.Tensor) -> None:
    """Add one chunk's sums. A function of its own so that the chunk's tensors die when it
    returns: a loop body's would live on into the next chunk's projection (three chunk-sized
    tensors at once, +0.5 GiB at a 128k vocabulary and 1024 positions)."""
    logits = logits.float()
    sums[2] += (logits.argmax(dim=-1) == target).sum().double()
    # In place: at most two chunk-sized tensors at once (the log-probabilities and their
    # exponentials, or logsumexp's temporary), as the chunked training loss's backward holds.
    logp = logits.sub_(logits.logsumexp(dim=-1, keepdim=True))
    sums[0] -= logp.gather(1, target[:, None]).sum().double()
    sums[1] += len(target)
    sums[3] -= logp.exp().mul_(logp).nansum().double()


def _measure_loss(loss_fn: Callable[[nn.Module, Any], LossSum], device: torch.device) -> Callable:
    """(loss sum, count) of a part through ``loss_fn`` (only the token-weighted term: aux
    terms stay out)."""

    def measure(model: nn.Module, part: Any) -> torch.Tensor:
        loss = loss_fn(model, part)
        count = torch.as_tensor(loss.count, device=device).double()
        return torch.stack([loss.total.double(), count])

    return measure


def _measure_logits(logits_fn: Callable[[nn.Module, Any], torch.Tensor]) -> Callable:
    def measure(model: nn.Module, part: Any) -> torch.Tensor:
        hidden = getattr(logits_fn, "hidden", None)
        split = hidden(model, part) if hidden is not None else None
        if split is not None:
            states, head = split
            return token_sums(states, part["labels"], head, logits_fn.chunk_tokens)
        return token_sums(logits_fn(model, part), part["labels"])

    return measure


def _sums(
    model: nn.Module,
    parts: Sequence[Any],
    measure: Callable[[nn.Module, Any], torch.Tensor],
    size: int,
    device: torch.device,
    agreement: OOMAgreement | None,
) -> torch.Tensor:
    """The summed ``measure`` of ``parts`` in float64; with ``agreement``, an
    out-of-memory in any part (on any rank) raises WindowOOM on every rank."""
    sums = torch.zeros(size, dtype=torch.float64, device=device)
    for part in parts:
        guard = agreement.guard(part) if agreement is not None else contextlib.nullcontext()
        with guard:
            sums += measure(model, part).to(device)
    return sums


def _batch_sums(
    model: nn.Module,
    batch: Any,
    measure: Callable[[nn.Module, Any], torch.Tensor],
    size: int,
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
            return _sums(model, parts, measure, size, device, agreement)
        except WindowOOM:
            if agreement.stuck() or state["halvings"] >= MAX_HALVINGS:
                raise too_large_error(state["halvings"], agreement.last_error) from None
            state["halvings"] += 1  # later batches start split too


@torch.no_grad()
def _summed(
    model: nn.Module,
    batches: Sequence[Batch],
    measure: Callable[[nn.Module, Any], torch.Tensor],
    size: int,
    device: torch.device,
    on_oom: str,
    split_fn: SplitFn | None,
) -> torch.Tensor:
    """``measure`` summed over the batches (eval mode) and over the ranks."""
    if on_oom not in ON_OOM:
        raise ValueError(f"on_oom must be one of {', '.join(ON_OOM)}; got {on_oom!r}")
    was_training = model.training
    model.eval()
    try:
        if on_oom == "raise":
            sums = _sums(model, batches, measure, size, device, None)
        else:
            split = split_fn or split_in_half
            sums = _split_sums(model, batches, measure, size, device, split)
    finally:
        model.train(was_training)
    return parallel.all_reduce_sum(sums)


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
    measure = _measure_loss(loss_fn or LMLoss(device), device)
    total, count = _summed(model, batches, measure, 2, device, on_oom, split_fn).tolist()
    return total / count if count else math.nan


def evaluate_metrics(
    model: nn.Module,
    batches: Sequence[Batch],
    device: torch.device,
    logits_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None,
    *,
    on_oom: str = "split",
    split_fn: SplitFn | None = None,
) -> Evaluation:
    """The :class:`Evaluation` of ``batches`` (``logits_fn``: default the demo GPT's); the
    loss is :func:`evaluate`'s, and batches split on out-of-memory as there."""
    measure = _measure_logits(logits_fn or Logits(device))
    sums = _summed(model, batches, measure, len(_SUMS), device, on_oom, split_fn)
    return Evaluation.of(sums)


def _split_sums(
    model: nn.Module,
    batches: Sequence[Batch],
    measure: Callable[[nn.Module, Any], torch.Tensor],
    size: int,
    device: torch.device,
    split_fn: SplitFn,
) -> torch.Tensor:
    strategy = parallel.strategy_for(model)
    caps = parallel.capabilities(strategy)
    agreement = OOMAgreement(caps.agree_sum, caps.agree_ranks)
    modules = caps.communicating_modules() if strategy.world_size > 1 else []
    sums = torch.zeros(size, dtype=torch.float64, device=device)
    state = {"halvings": 0}
    with agreement.before_forwards(modules):
        for batch in batches:
            sums += _batch_sums(model, batch, measure, size, device, agreement, state, split_fn)
    return sums


def sample_note(cfg: Any, source: Any, layout: Any) -> str | None:
    """What ``--eval-batches N`` leaves out of the validation set (None: it scores it all)."""
    if cfg.eval_batches is None:
        return None
    total = len(source.val.data.spans(cfg.seq_len, None, 1.0))
    rows = layout.micro_batch_size
    taken = min(total, cfg.eval_batches * rows)
    if taken == total:
        return None
    return (
        f"warning: validation scores a sample of {taken:,} of the {total:,} validation "
        f"sequences (--eval-batches {cfg.eval_batches} x {rows} per micro-batch), the same "
        "sample at every evaluation: val_loss and val_accuracy are that sample's; leave out "
        "--eval-batches to score the whole set"
    )
