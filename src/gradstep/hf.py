"""Hugging Face causal LMs with the exact step: the loss and the counter for HF-style batches.

``stepper.step(window, causal_lm_loss, count=count_tokens)`` trains any
``AutoModelForCausalLM`` (plain, PEFT-wrapped, DDP or FSDP2) on batches of HF's shape:
``input_ids``, optional ``attention_mask`` (right or left padding), and ``labels`` in HF's
*unshifted* convention (``labels[t]`` is the token at position ``t``; -100 is ignored).

Why a helper: every way of getting this wrong is silent. Forgetting the shift passes every
shape check; counting the unshifted labels is one token per sequence off; HF's mean loss
is NaN on a micro-batch with no targets; left padding makes the last pad predict the first
real token; and a MoE model's router loss is a per-micro-batch mean, which must not be
divided by the window's token count. Nothing here needs ``transformers`` itself: the model
is only called, so ``import gradstep`` works without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .loss import LossSum, token_loss
from .parallel import unwrap

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "causal_lm_targets", "count_tokens"]

IGNORE_INDEX = -100
AUX_NAME = "router"


def _tensor(batch: Mapping[str, Any], key: str, required: bool = True) -> torch.Tensor | None:
    if not isinstance(batch, Mapping):
        raise TypeError(
            "gradstep.hf: a micro-batch must be a mapping with input_ids, labels and an "
            f"optional attention_mask (HF's format), got a {type(batch).__name__}"
        )
    value = batch.get(key)
    if value is None and required:
        raise KeyError(f"gradstep.hf: the micro-batch has no {key!r}; it holds {sorted(batch)}")
    if value is not None and (not isinstance(value, torch.Tensor) or value.dim() != 2):
        raise ValueError(
            f"gradstep.hf: batch[{key!r}] must be a 2-dim tensor (batch, sequence), got "
            f"{getattr(value, 'shape', type(value).__name__)}"
        )
    return value


def causal_lm_targets(batch: Mapping[str, Any], *, shifted: bool = False) -> torch.Tensor:
    """The target of every logit position: shape ``(batch, seq - 1)`` (``seq`` if shifted).

    ``targets[:, t]`` is what position ``t`` predicts, ``labels[:, t + 1]``, or -100 when
    that label is ignored, when position ``t + 1`` is padding, or when position ``t`` itself
    is padding: with left padding the last pad would otherwise "predict" the first real
    token. ``shifted=True``: ``labels`` are already aligned with the logits (gradstep's own
    demo data); only the attention mask is applied.
    """
    labels = _tensor(batch, "labels")
    mask = _tensor(batch, "attention_mask", required=False)
    if mask is not None and mask.shape != labels.shape:
        raise ValueError(
            f"gradstep.hf: attention_mask shape {tuple(mask.shape)} differs from labels shape "
            f"{tuple(labels.shape)}"
        )
    if shifted:
        return labels if mask is None else labels.masked_fill(mask == 0, IGNORE_INDEX)
    targets = labels[:, 1:]
    if mask is not None:
        real = mask != 0
        targets = targets.masked_fill(~(real[:, 1:] & real[:, :-1]), IGNORE_INDEX)
    return targets


def count_tokens(batch: Mapping[str, Any], *, shifted: bool = False) -> int:
    """Targets of one micro-batch, as :func:`causal_lm_loss` counts them: the ``count=``
    of ``stepper.step`` (one host read per micro-batch, before any forward)."""
    return int((causal_lm_targets(batch, shifted=shifted) != IGNORE_INDEX).sum())


def _position_ids(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Positions counted over real tokens only, when some row is left-padded (a 0 before a
    1); None otherwise: right padding leaves HF's default positions right for every real
    token, and models without a ``position_ids`` argument keep working."""
    if mask is None:
        return None
    real = mask != 0
    left_padded = (real[:, 1:] & ~real[:, :-1]).any()
    if not bool(left_padded):
        return None
    return (real.long().cumsum(-1) - 1).clamp_min(0)


def _check_coef(aux_coef: float | None) -> None:
    if aux_coef is None:
        return
    if isinstance(aux_coef, bool) or not isinstance(aux_coef, (int, float)) or not aux_coef >= 0:
        raise ValueError(
            f"causal_lm_loss: aux_coef must be None or a number >= 0, got {aux_coef!r}"
        )


def _aux_coef(model: nn.Module, aux_coef: float | None) -> float:
    if aux_coef is not None:
        return float(aux_coef)
    config = getattr(unwrap(model), "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    if coef is None:
        raise ValueError(
            "causal_lm_loss: the model returned aux_loss but its config has no "
            "router_aux_loss_coef; pass aux_coef= (a number >= 0)"
        )
    return float(coef)


def causal_lm_loss(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    aux_coef: float | None = None,
    shifted: bool = False,
) -> LossSum:
    """Summed next-token cross-entropy of an HF causal LM, as a :class:`~gradstep.LossSum`.

    Calls ``model(input_ids=..., attention_mask=..., use_cache=False)`` without labels (so
    HF computes no second, unused loss), shifts inside (:func:`causal_lm_targets`), and sums
    the cross-entropy in at least float32. A left-padded batch also gets ``position_ids``
    counted over its real tokens, so padding changes no real token's position.

    A mixture-of-experts model whose output has ``aux_loss`` (HF computes it when
    ``config.output_router_logits`` is True) adds ``aux={"router": coef * aux_loss}``: a
    per-micro-batch term the Stepper averages over the window's micro-batches, never
    divided by the token count. ``coef`` is ``aux_coef``, else the model's
    ``config.router_aux_loss_coef`` (the coefficient HF's own loss would use); ``aux_coef=0``
    leaves the term out. Such a loss needs ``stepper.step(..., count=count_tokens)``.
    """
    _check_coef(aux_coef)
    input_ids = _tensor(batch, "input_ids")
    mask = _tensor(batch, "attention_mask", required=False)
    targets = causal_lm_targets(batch, shifted=shifted)
    if input_ids.shape != _tensor(batch, "labels").shape:
        raise ValueError(
            f"gradstep.hf: input_ids shape {tuple(input_ids.shape)} differs from labels shape "
            f"{tuple(batch['labels'].shape)}"
        )
    kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
    if mask is not None:
        kwargs["attention_mask"] = mask
    positions = batch.get("position_ids")
    positions = _position_ids(mask) if positions is None else positions
    if positions is not None:
        kwargs["position_ids"] = positions
    out = model(**kwargs)
    logits = out.logits if shifted else out.logits[:, :-1]
    loss = token_loss(logits, targets.to(logits.device))
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return loss
    coef = _aux_coef(model, aux_coef)
    if coef == 0:
        return loss
    return LossSum(loss.total, loss.count, aux={AUX_NAME: coef * aux.reshape(())})
