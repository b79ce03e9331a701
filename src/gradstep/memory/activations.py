"""Activation bytes of one micro-batch of the demo GPT: the per-token terms of the model.

Split out of :mod:`gradstep.memory.model` (which adds model states and the step's peaks).
Every term was checked against the bytes autograd saves (``saved_tensors_hooks``; see
``tests/memory/test_activations.py``), with and without dropout, in fp32 and under bf16
autocast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .shape import TransformerShape

__all__ = [
    "ATTENTION",
    "activations",
    "chunk_bytes",
    "chunked_head_terms",
    "packed_terms",
    "per_token_terms",
]

_FP32 = 4
_INT64 = 8
ATTENTION = ("fused", "math")
"""``fused``: SDPA's flash/efficient kernels (a logsumexp per head and token, no s^2
matrix). ``math``: the composite path (s^2 probabilities kept), which torch takes on CPU
when attention dropout is on (torch 2.13: the CPU flash kernel has no dropout)."""


@dataclass(frozen=True)
class _Bytes:
    """Element sizes of the step: parameter, compute, residual-stream and reduce dtypes."""

    param: int
    compute: int
    residual: int
    """The residual stream's dtype: that of the (unsharded) parameters, since the
    embedding output starts it and adds promote to it even under autocast."""
    unsharded: int
    frozen: int = 0
    """Frozen parameters' dtype (LoRA's base); 0: ``param``'s."""


def _attention(shape: TransformerShape, e_c: int, attention: str, rows: int) -> tuple[float, float]:
    """(bytes saved per token and block, backward temporaries) of the attention core.

    fused: ``3d*e_c`` qkv (the rotary multiplies and SDPA's v keep views of it, so the
    whole storage stays), ``2d*e_c`` rotated q and k, ``d*e_c`` the output (SDPA and, as a
    view, the out-projection keep it), ``4h`` the fp32 logsumexp.

    math (CPU computes it in float32 whatever the input dtype): the scaled q and k
    (``2d*4``); v (``d*4``: a copy, except for one fp32 row, where the batched matmul's v
    is a view that keeps the whole qkv storage, ``3d*4``);
    the out-projection's input, now a copy (``d*e_c``); and per head three ``T x T`` fp32
    matrices: the softmax output, the dropout mask and the dropped probabilities. Its
    backward adds two ``T x T`` gradients.
    """
    # One tensor-parallel rank's heads (all of them without tensor parallel).
    d, h, t = shape.d_model // shape.tp, shape.n_head // shape.tp, shape.seq_len
    if attention == "fused":
        return 6 * d * e_c + 4 * h, 0.0
    v = 3 * d * e_c if e_c == _FP32 and rows == 1 else d * _FP32
    return v + 2 * d * _FP32 + d * e_c + 3 * h * t * _FP32, 2 * h * t * _FP32


def per_token_terms(
    shape: TransformerShape,
    b: _Bytes,
    dropout: bool = False,
    attention: str = "fused",
    rows: int = 1,
) -> dict[str, float]:
    """Activation bytes per token, by where they are kept (the formulas of the model).

    Per block (``n`` norms, ``d`` model width, ``f`` MLP width, ``h`` heads; with
    ``shape.tp`` tensor-parallel ranks, ``f`` and the attention core's ``d`` and ``h`` are
    one rank's share, divided by ``tp``):

    * ``n*d*e_r``: each LayerNorm's input (its backward needs it);
    * ``n*2*e_r``: each LayerNorm's mean and rstd;
    * ``n*d*e_c``: each norm's output, the input of the next matmul (qkv, fc);
    * the attention core (:func:`_attention`: ``6d*e_c + 4h`` with fused kernels);
    * ``2f*e_c``: the fc output (GELU's backward) and the GELU output (down-projection's);
    * with ``dropout``: the masks of the two residual branches (``2d*e_c``; torch's CPU
      dropout keeps a mask in the input's dtype).

    Head: final norm input, stats and output; the fp32 log-softmax over the vocabulary
    (``token_loss`` upcasts the logits; log_softmax keeps its output); int64 ids and targets.
    ``stem``: with dropout, the embedding dropout's mask (``d*e_r``), kept until the very
    end of backward. Temporaries at the backward peak: ``ce`` = two fp32 ``(tokens, V)``
    gradients (w.r.t. the log-probs and the logits) alive together in log_softmax's
    backward; ``block`` = the gradient of a block's output (``d*e_r``) and of its MLP
    hidden (``f*e_c``) in the down-projection's backward (+ the math attention's).
    ``rows``: sequences in the micro-batch (one term of the math attention depends on it).
    """
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    d, n, v = shape.d_model, shape.norms_per_block, shape.vocab_size
    f = shape.ffn // shape.tp  # the MLP's hidden width on one tensor-parallel rank
    e_c, e_r = b.compute, b.residual
    core, core_tmp = _attention(shape, e_c, attention, rows)
    masks = 2 * d * e_c if dropout else 0
    block = n * d * e_r + n * 2 * e_r + n * d * e_c + core + 2 * f * e_c + masks
    head = d * e_r + 2 * e_r + d * e_c + v * _FP32 + 2 * _INT64
    return {
        "block": block,
        "head": head,
        "stem": d * e_r if dropout else 0,
        "block_input": d * e_r,
        "ce_temporaries": 2 * v * _FP32,
        "block_temporaries": d * e_r + f * e_c + core_tmp,
    }


def chunked_head_terms(
    terms: dict[str, float], d: int, e_hidden: int, e_r: int, full_head: float
) -> dict[str, float]:
    """``terms`` with the head of :func:`gradstep.step.loss.chunked_token_loss` instead of
    the whole logits: per token the hidden states it saves (``d*e_hidden``: a copy of the
    target positions' rows) and the kept positions (``INT64``; the targets were counted
    already) replace the head's input copy and its ``(tokens, V)`` float32 log-softmax
    (``full_head``: those bytes, ``d*e + V*4``); the backward's ``ce`` temporaries become
    the hidden states' gradient (``d*e_r``). The chunk's own buffers do not grow with the
    micro-batch (:func:`chunk_bytes`)."""
    out = dict(terms)
    out["head"] = terms["head"] - full_head + d * e_hidden + _INT64
    out["ce_temporaries"] = d * e_r
    return out


def packed_terms(
    terms: dict[str, float], seq_len: int, e_attention: int, rope: float, layers: int = 0
) -> dict[str, float]:
    """``terms`` for packed rows (``--packing``: a block-causal mask, positions restarting at
    each sequence). Per token of a row of ``seq_len`` positions: the boolean
    ``(rows, 1, T, T)`` mask (``T`` bytes) and the int64 ``seq_ids`` and ``position_ids``,
    kept the whole step (``stem``), with ``rope`` bytes of rotary tables per position (a
    row's own, not shared by the rows); and in every attention layer (``block``, and
    ``blocks`` of ``layers`` layers where the terms sum them: an HF model's), the mask as
    SDPA turns it into an additive one in the query's dtype ``e_attention`` and saves it
    for backward (torch 2.13 on CPU: one ``T x T`` copy per row and layer, measured)."""
    out = dict(terms)
    out["stem"] = terms["stem"] + seq_len + 2 * _INT64 + rope
    out["block"] = terms["block"] + e_attention * seq_len
    if layers:
        out["blocks"] = terms["blocks"] + layers * e_attention * seq_len
    return out


def chunk_bytes(
    vocab: int, d: int, chunk: int, tokens: int, e_c: int, e_weight: int, head_grad: bool
) -> int:
    """Backward-peak bytes of the chunked loss that do not grow with the micro-batch: one
    chunk's float32 ``(min(chunk, tokens), V)`` logits, exponentiated and turned into the
    softmax's gradient in place, plus its copy in the compute dtype ``e_c`` when that is
    not float32 (autocast's projection, the gradient cast back for the matmuls); and, when
    the head trains, its weight gradient's accumulator and one chunk's ``(V, d)``
    contribution (``grad_weight += d.t() @ rows``)."""
    rows = min(chunk, tokens)
    logits = rows * vocab * (_FP32 + (e_c if e_c != _FP32 else 0))
    weight = vocab * d * (e_weight + e_c) if head_grad else 0
    return logits + weight


def activations(
    shape: TransformerShape,
    b: _Bytes,
    micro_batch_size: int,
    checkpointing: bool,
    dropout: bool = False,
    attention: str = "fused",
    loss_chunk_tokens: int = 0,
    packed: bool = False,
) -> tuple[int, float]:
    """(peak activation bytes, bytes per item) of one micro-batch.

    Without checkpointing the peak is in the loss's backward (everything saved + ``ce``),
    or, for very wide MLPs, in the top block's backward (head tensors already freed).
    With checkpointing the forward keeps only each block's input; backward recomputes one
    block at a time, so the peak is ``(L-1)`` inputs + one block's saved set (which holds
    its own input) + that block's gradient temporaries, or the head phase if larger.

    ``loss_chunk_tokens=N`` (not 0): the loss is :func:`gradstep.step.loss.chunked_token_loss`
    (the demo GPT's ``loss_chunk_tokens``): the head phase holds one chunk's logits
    (:func:`chunk_bytes`) instead of the whole micro-batch's (:func:`chunked_head_terms`).
    The bytes per item are then the slope of the peak in the micro-batch size.
    ``packed``: rows of ``--packing`` (:func:`packed_terms`; each row's own rotary tables).
    """
    t = per_token_terms(shape, b, dropout, attention, micro_batch_size)
    d, e_r, e_c = shape.d_model, b.residual, b.compute
    if packed:
        t = packed_terms(t, shape.seq_len, e_c, 2 * shape.head_dim * e_r)
    fixed = 0
    if loss_chunk_tokens:
        t = chunked_head_terms(t, d, e_r, e_r, d * e_c + shape.vocab_size * _FP32)
        tokens = micro_batch_size * shape.seq_len
        fixed = chunk_bytes(shape.vocab_size, d, loss_chunk_tokens, tokens, e_c, e_r, True)
    layers = shape.n_layer
    if checkpointing:
        head_phase = layers * t["block_input"] + t["head"] + t["ce_temporaries"]
        block_phase = (layers - 1) * t["block_input"] + t["block"] + t["block_temporaries"]
    else:
        head_phase = layers * t["block"] + t["head"] + t["ce_temporaries"]
        block_phase = layers * t["block"] + t["block_temporaries"]
    # cos/sin tables of (seq_len, head_dim), in the residual dtype, shared by all blocks
    # (packed: each row's own, in ``stem``).
    rope = 0 if packed else 2 * shape.seq_len * shape.head_dim * b.residual
    items = micro_batch_size * shape.seq_len
    per_item = (max(head_phase, block_phase) + t["stem"]) * shape.seq_len
    if not fixed:
        return round(per_item * micro_batch_size + rope), per_item
    peak = max(head_phase * items + fixed, block_phase * items) + t["stem"] * items
    return round(peak + rope), per_item
