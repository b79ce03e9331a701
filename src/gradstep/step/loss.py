"""Losses as (sum, count) pairs, so that one place can normalise over a whole window.

A mean loss per micro-batch throws away how many items produced it; averaging those
means over micro-batches of different sizes (or ranks with different token counts)
weights items unequally. Returning the *sum* and the *count* lets the Stepper divide
once, by the true global item count.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True, eq=False)
class LossSum:
    """Sum of per-item losses and the number of items that produced it, plus auxiliary terms.

    ``total`` is a 0-dim tensor that carries grad; ``count`` is an int (or 0-dim integer
    tensor) >= 0: tokens whose label is not ignored, or samples.

    ``aux`` maps names to 0-dim tensors that carry grad: per-micro-batch terms (e.g. a MoE
    router's load-balancing loss, already times its coefficient) whose contribution to the
    step is their MEAN over every micro-batch of the window on every rank, while
    ``total / count`` stays the item-weighted mean. The step's gradient is that of
    ``sum(total) / sum(count) + mean(aux)``; weighting it needs the window's item count
    before the first backward: ``stepper.step(window, loss_fn, count=fn)``. Every
    micro-batch of the window, on every rank, returns the same names (a zero term where
    one does not apply): a term missing somewhere is an error, not a mean over fewer.

    ``count=None`` means "as ``count(micro_batch)`` said": with ``step(..., count=fn)``
    the items are counted up front (as a hand-written loop does), and the loss function
    need not count them again between its forward and its backward.

    Unpacks as ``total, count = loss`` (the auxiliary terms stay in ``loss.aux``).
    """

    total: torch.Tensor
    count: int | torch.Tensor | None
    aux: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.total, self.count))


def token_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, count: bool = True
) -> LossSum:
    """Causal-LM cross-entropy as a :class:`LossSum`.

    ``labels`` must already be aligned with ``logits`` (``labels[..., t]`` is the target of
    position ``t``; shift before calling). Positions labelled ``ignore_index`` contribute
    neither to the sum nor to the count. The sum is taken in at least float32, even under autocast.
    ``count=False`` leaves the count to ``step(..., count=fn)`` (``LossSum.count`` None).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"token_loss: logits shape {tuple(logits.shape)} does not match labels shape "
            f"{tuple(labels.shape)} (expected logits = labels.shape + (vocab,))"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # softmax + sum over many tokens in half precision drifts
    total = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return LossSum(total, (labels != ignore_index).sum() if count else None)


def check_loss_sum(out: object, count: bool = True, sign: bool = True) -> LossSum:
    """Validate what a user's ``loss_fn`` returned; raise a clear error otherwise.

    ``count=False``: ``out.count`` may be None (``step(..., count=fn)`` counted the
    micro-batch). ``sign=False`` leaves an int count's sign to the caller (the Stepper
    checks it once per window, on every rank alike, after its collective).
    """
    if not isinstance(out, LossSum):
        kind = type(out).__name__
        hint = (
            " A plain tensor is ambiguous (mean or sum?): return "
            "gradstep.LossSum(total=loss_sum, count=n_items)."
            if isinstance(out, torch.Tensor)
            else ""
        )
        raise TypeError(f"loss_fn must return gradstep.LossSum(total, count), got {kind}.{hint}")
    total = out.total
    if out.aux:
        _check_aux(out.aux)
    if not isinstance(total, torch.Tensor) or total.dim() != 0:
        raise TypeError("LossSum.total must be a 0-dim tensor (the SUM of per-item losses)")
    if not total.requires_grad:
        raise ValueError(
            "LossSum.total does not require grad: it was computed under torch.no_grad(), "
            "detached, or from no trainable parameter; return the loss sum the model produced"
        )
    if count or out.count is not None:
        check_count(out.count, sign=sign)
    return out


def _check_aux(aux: Mapping[str, Any]) -> None:
    for name, term in aux.items():
        if not isinstance(name, str) or not isinstance(term, torch.Tensor) or term.dim() != 0:
            raise TypeError(
                f"LossSum.aux must map names (str) to 0-dim tensors, got {name!r}: "
                f"{type(term).__name__}"
            )
        if not term.requires_grad:
            raise ValueError(f"LossSum.aux[{name!r}] does not require grad: it adds nothing")


def check_count(count: object, sign: bool = True) -> None:
    """``LossSum.count``: an int >= 0 or a 0-dim integer tensor (a tensor's sign is checked
    where it is read, so that a device tensor costs no host sync here; ``sign=False``
    leaves an int's sign to the caller too, which checks it on every rank alike)."""
    if count is None:
        raise TypeError(
            "LossSum.count is None, which means 'the count of step(..., count=fn)': pass "
            "count=fn, fn(micro_batch) -> its items, or return the count"
        )
    if isinstance(count, torch.Tensor):
        if count.dim() != 0 or count.is_floating_point() or count.dtype == torch.bool:
            raise TypeError("LossSum.count must be an int or a 0-dim integer tensor")
    elif not isinstance(count, int) or isinstance(count, bool):
        raise TypeError(f"LossSum.count must be an int >= 0, got {type(count).__name__}")
    elif sign and count < 0:
        raise ValueError(f"LossSum.count must be >= 0, got {count}")


CHUNK_TOKENS = 1024
"""Positions whose logits :func:`chunked_token_loss` holds at once, by default: 1024 x a
128k vocabulary is 0.5 GB in float32, against 8 GB for a micro-batch of 8 x 2048."""


def chunked_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    chunk_tokens: int = CHUNK_TOKENS,
) -> LossSum:
    """:func:`token_loss` of ``linear(hidden, weight, bias)`` without the whole logits.

    ``hidden`` is ``(..., d)`` (the last hidden states, aligned with ``labels``, shape
    ``(...)``); ``weight`` ``(vocab, d)`` is the output projection (a tied embedding
    too). The logits are computed ``chunk_tokens`` positions at a time, reduced to their
    cross-entropy sum, and dropped; backward computes each chunk's logits again (a second
    output projection, the price of never holding the ``(..., vocab)`` logits or their
    gradient). Positions labelled ``ignore_index`` never reach the projection. Equal to
    ``token_loss(linear(hidden, weight, bias), labels)`` to rounding (the sum's order),
    gradients included; under autocast the projection runs in autocast's dtype, as a
    ``Linear`` would, and the sum in at least float32.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"chunked_token_loss: hidden shape {tuple(hidden.shape)} does not match labels "
            f"shape {tuple(labels.shape)} (expected hidden = labels.shape + (d,))"
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(
            f"chunked_token_loss: chunk_tokens must be an int >= 1, got {chunk_tokens!r}"
        )
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    keep = (targets != ignore_index).nonzero().squeeze(1)
    total = _ChunkedCrossEntropy.apply(flat[keep], weight, bias, targets[keep], chunk_tokens)
    return LossSum(total, keep.numel())


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of cross-entropies of ``linear(hidden, weight, bias)`` rows against ``targets``
    (every target valid), chunk by chunk in forward and again in backward, the projection in
    one dtype both times (autocast's when it is on, as a ``Linear`` would be computed). A
    chunk's peak is one ``(chunk, vocab)`` tensor in the sum's dtype (plus autocast's
    low-precision projection while it is copied)."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, chunk):  # type: ignore[no-untyped-def]
        device = hidden.device.type
        ctx.dtype = (
            torch.get_autocast_dtype(device)
            if torch.is_autocast_enabled(device)
            else torch.promote_types(hidden.dtype, weight.dtype)
        )
        ctx.chunk = chunk
        ctx.save_for_backward(hidden, weight, bias, targets)
        total = torch.zeros((), dtype=_sum_dtype(hidden, weight), device=hidden.device)
        with torch.autocast(device, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                # In the sum's dtype, a buffer of its own: it is overwritten below.
                logits = _logits(hidden[start : start + chunk], weight, bias, ctx.dtype)
                logits = logits.to(total.dtype)
                try:
                    picked = logits.gather(1, targets[start : start + chunk, None]).sum()
                except RuntimeError as exc:  # an IndexError, as F.cross_entropy's: callers
                    raise IndexError(f"target out of range: {exc}") from exc  # name the key
                exp, top = _exp_shifted_(logits)
                # CE = logsumexp - the target's logit, summed over the chunk's rows.
                total = total + (exp.sum(-1).log_() + top.squeeze(-1)).sum() - picked
                del logits, exp  # before the next chunk's projection, not after it
        return total

    @staticmethod
    def backward(ctx: Any, grad_total):  # type: ignore[no-untyped-def]
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight) if need_w else None
        grad_bias = torch.zeros_like(bias) if need_b and bias is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows, end = hidden[start : start + ctx.chunk], start + ctx.chunk
            # d(sum of CE)/d(logits) = softmax - one_hot, times the incoming gradient, made
            # in place in the logits' own buffer (as in forward).
            exp, _ = _exp_shifted_(_logits(rows, weight, bias, ctx.dtype).to(grad_total.dtype))
            d = exp.div_(exp.sum(-1, keepdim=True))
            d[torch.arange(d.shape[0], device=d.device), targets[start:end]] -= 1
            d = d.mul_(grad_total).to(ctx.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (d @ weight.to(ctx.dtype)).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (d.t() @ rows.to(ctx.dtype)).to(weight.dtype)
            if grad_bias is not None:
                grad_bias += d.sum(0).to(bias.dtype)
            del exp, d  # before the next chunk's projection, not after it
        return grad_hidden, grad_weight, grad_bias, None, None


def _logits(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    return F.linear(rows.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def _exp_shifted_(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(logits - max)`` IN PLACE, and the row maxima: the numerators of softmax and
    logsumexp (shifted so that exp cannot overflow) without a second ``(rows, vocab)``
    buffer, so a chunk holds one such tensor at a time (``F.cross_entropy`` or
    ``torch.softmax`` would allocate their output beside the logits)."""
    top = logits.amax(-1, keepdim=True)
    return logits.sub_(top).exp_(), top


def _sum_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """At least float32: a cross-entropy sum in half precision drifts (as token_loss)."""
    return torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
