"""Hugging Face causal LMs with the exact step: the loss and the counter for HF-style batches.

``stepper.step(window, causal_lm_loss, count=count_tokens)`` trains any
``AutoModelForCausalLM`` (plain, PEFT-wrapped, DDP or FSDP2) on batches of HF's shape:
``input_ids``, optional ``attention_mask`` (right or left padding), and ``labels`` in HF's
*unshifted* convention (``labels[t]`` is the token at position ``t``; -100 is ignored), or
HF's ``shift_labels`` (already aligned with the logits: ``shift_labels[t]`` is the target
of position ``t``).

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

from ._validate import check_number
from .errors import GradstepError
from .parallel import unwrap
from .step.loss import LossSum, chunked_token_loss, token_loss

__all__ = [
    "FORWARDED_KEYS",
    "IGNORE_INDEX",
    "BatchError",
    "causal_lm_loss",
    "causal_lm_targets",
    "chunkable",
    "count_tokens",
    "forward_hidden",
]

IGNORE_INDEX = -100
AUX_NAME = "router"
FORWARDED_KEYS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")
"""Batch keys :func:`causal_lm_loss` passes to the model when present (``labels`` and
``shift_labels`` it consumes itself; every other key is left out of the call)."""


class BatchError(GradstepError, ValueError):
    """A micro-batch :mod:`gradstep.hf` cannot train on; the message names the key and
    what it must hold."""


def _mask(batch: Mapping[str, Any]) -> tuple[torch.Tensor | None, bool]:
    """(attention_mask, packed): a 4-D mask is a packed batch's (:mod:`gradstep.packing`),
    whose padding and sequence ends its aligned labels already mark."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        return mask, True
    return _tensor(batch, "attention_mask", required=False), False


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
        raise BatchError(
            f"gradstep.hf: batch[{key!r}] must be a 2-dim tensor (batch, sequence), got "
            f"{getattr(value, 'shape', type(value).__name__)}"
        )
    return value


def _integer(key: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` as token ids; a float or bool tensor is refused (its dtype is metadata:
    checking it costs no device sync)."""
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise BatchError(
            f"gradstep.hf: batch[{key!r}] must hold integer token ids (torch.long), got "
            f"{value.dtype}; convert it with .long()"
        )
    return value


def _labels(batch: Mapping[str, Any], shifted: bool) -> tuple[str, torch.Tensor, bool]:
    """(key, labels, aligned): HF's ``shift_labels`` when the batch has them (already
    aligned with the logits, as in HF's own loss, which then ignores ``labels``), else
    ``labels``, aligned when ``shifted``."""
    if isinstance(batch, Mapping) and batch.get("shift_labels") is not None:
        return "shift_labels", _integer("shift_labels", _tensor(batch, "shift_labels")), True
    if isinstance(batch, Mapping) and batch.get("labels") is None:
        raise KeyError(
            f"gradstep.hf: the micro-batch has no 'labels' (or 'shift_labels'); it holds "
            f"{sorted(batch)}"
        )
    return "labels", _integer("labels", _tensor(batch, "labels")), shifted


def causal_lm_targets(batch: Mapping[str, Any], *, shifted: bool = False) -> torch.Tensor:
    """The target of every logit position: shape ``(batch, seq - 1)`` (``seq`` if aligned).

    ``targets[:, t]`` is what position ``t`` predicts, ``labels[:, t + 1]``, or -100 when
    that label is ignored, when position ``t + 1`` is padding, or when position ``t`` itself
    is padding: with left padding the last pad would otherwise "predict" the first real
    token. Labels already aligned with the logits (a ``shift_labels`` key, HF's name, or
    ``labels`` with ``shifted=True``) get the same mask rule; the last position's next
    token is not in the batch, so only its own mask counts there.
    """
    key, labels, aligned = _labels(batch, shifted)
    mask, packed = _mask(batch)
    if packed:
        if not aligned:
            raise BatchError(
                "gradstep.hf: a packed batch (a 4-D attention_mask) needs labels aligned with "
                "its inputs (shift_labels, as gradstep.packing.pack makes them): unshifted "
                "labels would make a sequence's last token predict the next sequence's first"
            )
        return labels
    if mask is not None and mask.shape != labels.shape:
        raise BatchError(
            f"gradstep.hf: attention_mask shape {tuple(mask.shape)} differs from {key} shape "
            f"{tuple(labels.shape)}"
        )
    if aligned:
        if mask is None:
            return labels
        real = mask != 0
        after = torch.cat([real[:, 1:], real[:, -1:]], dim=1)
        return labels.masked_fill(~(real & after), IGNORE_INDEX)
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


def _wants_router(model: nn.Module, aux_coef: float | None) -> bool:
    """Whether to ask this forward for the router loss: a coefficient > 0 was given.

    HF MoE configs ship ``output_router_logits=False``, which makes the forward return no
    ``aux_loss``; ``output_router_logits=True`` in the call turns it on for that forward.
    A model whose config has no such field has no router: a coefficient is a mistake.
    """
    if not aux_coef:
        return False
    config = getattr(unwrap(model), "config", None)
    if not hasattr(config, "output_router_logits"):
        raise ValueError(
            f"causal_lm_loss: aux_coef={aux_coef!r} asks for a router (load-balancing) loss, "
            f"but {type(unwrap(model)).__name__} is not a mixture of experts (its config has "
            "no output_router_logits); leave aux_coef=None for a dense model"
        )
    return True


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


def _vocab(model: nn.Module) -> int | None:
    embed = getattr(unwrap(model), "get_input_embeddings", None)
    table = embed() if callable(embed) else None
    return getattr(table, "num_embeddings", None)


def _out_of_range(key: str, ids: torch.Tensor, vocab: int | None) -> BatchError | None:
    """The error for ids outside ``[0, vocab)`` (-100 allowed in labels), or None: called
    only after torch refused an index, so reading the ids back costs nothing on the fast
    path."""
    if vocab is None:
        return None
    ids = ids.detach().cpu()
    bad = ids[(ids < 0) | (ids >= vocab)]
    if key != "input_ids":
        bad = bad[bad != IGNORE_INDEX]
    if bad.numel() == 0:
        return None
    ignored = "" if key == "input_ids" else f" ({IGNORE_INDEX} marks an ignored position)"
    return BatchError(
        f"gradstep.hf: batch[{key!r}] holds {int(bad[0])}, outside the model's vocabulary "
        f"[0, {vocab}){ignored}; {bad.numel()} such value(s). Check the tokenizer matches "
        "the model"
    )


def _forward(model: nn.Module, batch: Mapping[str, Any], router: bool) -> Any:
    """The model's forward on the keys in :data:`FORWARDED_KEYS`, without labels (HF would
    compute a second, unused loss) and without a KV cache."""
    input_ids = _integer("input_ids", _tensor(batch, "input_ids"))
    mask, packed = _mask(batch)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
    if mask is not None:
        kwargs["attention_mask"] = mask
    positions = batch.get("position_ids")
    if positions is None and packed:
        raise BatchError("gradstep.hf: a packed batch needs position_ids (restarting per sequence)")
    positions = _position_ids(mask) if positions is None else positions
    if positions is not None:
        kwargs["position_ids"] = positions
    if batch.get("token_type_ids") is not None:
        kwargs["token_type_ids"] = batch["token_type_ids"]
    if router:
        kwargs["output_router_logits"] = True
    try:
        return model(**kwargs)
    except IndexError as exc:
        error = _out_of_range("input_ids", input_ids, _vocab(model))
        if error is None:
            raise
        raise error from exc


def _hf_model(model: nn.Module) -> nn.Module:
    """The ``PreTrainedModel`` inside DDP, ``torch.compile`` and PEFT wrappers."""
    inner = unwrap(model)
    get = getattr(inner, "get_base_model", None)
    return get() if callable(get) else inner


def chunkable(model: nn.Module) -> str | None:
    """Why ``causal_lm_loss(..., chunk_tokens=N)`` cannot leave out the whole logits of
    ``model``, or None when it can: its output projection must be a plain ``nn.Linear``
    (not a LoRA-adapted one) and nothing may follow it (a logit softcap or scale)."""
    hf = _hf_model(model)
    get = getattr(hf, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear:
        kind = "none" if head is None else type(head).__name__
        return f"its output projection is a {kind}, not a plain nn.Linear (e.g. LoRA-adapted)"
    config = getattr(hf, "config", None)
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "its logits are soft-capped after the projection (final_logit_softcapping)"
    if getattr(hf, "logit_scale", None) is not None:
        return "its logits are scaled after the projection (logit_scale)"
    return None


class _Hidden(nn.Module):
    """Stands in for the output projection during one forward: its "logits" are the hidden
    states the projection would have read."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _forward_hidden(model: nn.Module, batch: Mapping[str, Any], router: bool) -> tuple:
    """(output, hidden states, the output projection): the forward with the projection
    left out. The projection module is swapped out only for the call: its parameters stay
    where the wrappers manage them (FSDP2 gathers them into the module it holds, which is
    the one returned here)."""
    hf = _hf_model(model)
    head = hf.get_output_embeddings()
    hf.set_output_embeddings(_Hidden())
    try:
        out = _forward(model, batch, router)
    finally:
        hf.set_output_embeddings(head)
    return out, out.logits, head


def forward_hidden(model: nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, nn.Module]:
    """(hidden states, output projection): the forward of ``batch`` (the keys
    :func:`causal_lm_loss` passes) stopped before the projection, so a caller can apply it a
    few positions at a time (evaluation without the whole logits). Refused as
    :func:`chunkable` says (a ``ValueError``)."""
    why = chunkable(model)
    if why is not None:
        raise ValueError(f"forward_hidden: the projection cannot be left out: {why}")
    _, hidden, head = _forward_hidden(model, batch, router=False)
    return hidden, head


def causal_lm_loss(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    aux_coef: float | None = None,
    shifted: bool = False,
    chunk_tokens: int | None = None,
) -> LossSum:
    """Summed next-token cross-entropy of an HF causal LM, as a :class:`~gradstep.LossSum`.

    Calls the model on ``input_ids``, ``attention_mask``, ``position_ids`` and
    ``token_type_ids`` (those present; :data:`FORWARDED_KEYS`) with ``use_cache=False`` and
    without labels (so HF computes no second, unused loss), shifts inside
    (:func:`causal_lm_targets`; a ``shift_labels`` key is taken as already shifted), and
    sums the cross-entropy in at least float32. A left-padded batch also gets
    ``position_ids`` counted over its real tokens, so padding changes no real token's
    position. Other keys are not passed to the model.

    Router loss of a mixture-of-experts model: ``aux_coef > 0`` asks the forward for it
    (``output_router_logits=True``, whatever the config says) and adds
    ``aux={"router": aux_coef * aux_loss}``, a per-micro-batch term the Stepper averages
    over the window's micro-batches, never divided by the token count; on a model without
    a router it is a ``ValueError``. ``aux_coef=None`` follows the config: the term is added
    (times ``config.router_aux_loss_coef``) when ``config.output_router_logits`` is True.
    ``aux_coef=0`` leaves it out. Such a loss needs ``stepper.step(..., count=count_tokens)``.

    A token or label id outside the vocabulary is a :class:`BatchError` naming the key
    (diagnosed after torch refuses the index, so the fast path reads nothing back).

    ``chunk_tokens=N``: the whole logits are never held: the forward stops before the output
    projection, which :func:`gradstep.step.loss.chunked_token_loss` applies N positions at
    a time (again in backward); the same sum, count and gradients to rounding. A model
    :func:`chunkable` refuses raises ``ValueError`` saying why.
    """
    check_number("aux_coef", aux_coef, "causal_lm_loss", optional=True, error=ValueError)
    router = _wants_router(model, aux_coef)
    key, labels, aligned = _labels(batch, shifted)
    targets = causal_lm_targets(batch, shifted=shifted)
    input_ids = _tensor(batch, "input_ids")
    if input_ids.shape != labels.shape:
        raise BatchError(
            f"gradstep.hf: input_ids shape {tuple(input_ids.shape)} differs from {key} shape "
            f"{tuple(labels.shape)}"
        )
    if chunk_tokens is None:
        out = _forward(model, batch, router)
        logits = out.logits if aligned else out.logits[:, :-1]
        loss = _checked(lambda t: token_loss(logits, t), key, targets, logits)
    else:
        why = chunkable(model)
        if why is not None:
            raise ValueError(f"causal_lm_loss: chunk_tokens= cannot be used here: {why}")
        out, hidden, head = _forward_hidden(model, batch, router)
        hidden = hidden if aligned else hidden[:, :-1]

        def loss_of(t: torch.Tensor) -> LossSum:
            return chunked_token_loss(hidden, head.weight, t, head.bias, chunk_tokens=chunk_tokens)

        loss = _checked(loss_of, key, targets, head.weight)
    return _with_router_loss(loss, out, model, router, aux_coef)


def _with_router_loss(
    loss: LossSum, out: Any, model: nn.Module, router: bool, aux_coef: float | None
) -> LossSum:
    """``loss`` with the MoE router's load-balancing loss as ``aux["router"]`` (see
    :func:`causal_lm_loss`), when the forward returned one and its coefficient is not 0."""
    aux = getattr(out, "aux_loss", None)
    if router and aux is None:
        raise ValueError(
            f"causal_lm_loss: aux_coef={aux_coef!r} was given and the forward was asked for "
            "router logits, but the model returned no aux_loss"
        )
    if aux is None:
        return loss
    coef = _aux_coef(model, aux_coef)
    if coef == 0:
        return loss
    return LossSum(loss.total, loss.count, aux={AUX_NAME: coef * aux.reshape(())})


def _checked(loss_of: Any, key: str, targets: torch.Tensor, logits: torch.Tensor) -> LossSum:
    """``loss_of(targets)``, a target outside the vocabulary (``logits``' first dim of a
    projection weight, or last of logits) named as a :class:`BatchError`."""
    targets = targets.to(device=logits.device, dtype=torch.long)
    vocab = logits.size(-1) if logits.dim() == 3 else logits.size(0)
    try:
        return loss_of(targets)
    except IndexError as exc:
        error = _out_of_range(key, targets, vocab)
        if error is None:
            raise
        raise error from exc
