"""The LM loss and the plain full-batch reference step that every parity claim is checked
against: ONE batch holding every sequence of the window (of every rank), the mean token
loss over all of it, one backward, torch's own ``clip_grad_norm_`` and optimizer.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import gradstep
from gradstep_cli.data.sources import IGNORE_INDEX
from tests.support.batches import Batch


def lm_loss(model: nn.Module, mb: Batch) -> gradstep.LossSum:
    """The loss_fn of the LM tests and benchmarks: token-loss sum and token count."""
    return gradstep.token_loss(model(mb["input_ids"]), mb["labels"])


def failing_loss(on_call: int, message: str = "micro-batch 2 failed"):  # noqa: ANN201
    """``lm_loss`` that raises RuntimeError(message) on its ``on_call``-th call (1-based):
    a window that fails part-way."""
    calls = []

    def loss(model: nn.Module, mb: Batch) -> gradstep.LossSum:
        calls.append(1)
        if len(calls) == on_call:
            raise RuntimeError(message)
        return lm_loss(model, mb)

    return loss


def mean_token_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross-entropy averaged over every non-ignored token of ``batch``."""
    logits = model(batch["input_ids"])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1), ignore_index=IGNORE_INDEX
    )


def reference_step(
    model: nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
) -> dict[str, Any]:
    """One plain full-batch step on ``model`` itself (no copy).

    Zero the gradients, backward of the mean token loss of ``batch``, then, if given,
    ``clip_grad_norm_(max_norm, norm_type)`` and ``optimizer.step()``. Returns the mean
    loss, the token count, the pre-clip norm, the clip coefficient (``clip_grad_norm_``'s
    formula) and the gradients by name, after the clip and before the optimizer step.
    """
    model.zero_grad(set_to_none=True)
    loss = mean_token_loss(model, batch)
    loss.backward()
    params = list(model.parameters())
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type))
    coef = 1.0
    if max_norm is not None:
        coef = min(1.0, max_norm / (norm + 1e-6))
        torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if optimizer is not None:
        optimizer.step()
    return {
        "loss": loss.item(),
        "items": int((batch["labels"] != IGNORE_INDEX).sum()),
        "grad_norm": norm,
        "clip_coef": coef,
        "grads": grads,
    }


def reference_grads(
    model: nn.Module, batch: Batch, dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], float]:
    """:func:`reference_step` on a copy of ``model`` (cast to ``dtype`` if given): the
    gradient, in parameter order, and the mean loss; ``model`` itself is untouched."""
    ref = copy.deepcopy(model)
    if dtype is not None:
        ref = ref.to(dtype)
    out = reference_step(ref, batch)
    return list(out["grads"].values()), out["loss"]
