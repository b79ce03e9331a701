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

__all__ = ["ATTENTION", "activations", "per_token_terms"]

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


def activations(
    shape: TransformerShape,
    b: _Bytes,
    micro_batch_size: int,
    checkpointing: bool,
    dropout: bool = False,
    attention: str = "fused",
) -> tuple[int, float]:
    """(peak activation bytes, bytes per item) of one micro-batch.

    Without checkpointing the peak is in the loss's backward (everything saved + ``ce``),
    or, for very wide MLPs, in the top block's backward (head tensors already freed).
    With checkpointing the forward keeps only each block's input; backward recomputes one
    block at a time, so the peak is ``(L-1)`` inputs + one block's saved set (which holds
    its own input) + that block's gradient temporaries, or the head phase if larger.
    """
    t = per_token_terms(shape, b, dropout, attention, micro_batch_size)
    layers = shape.n_layer
    if checkpointing:
        head_phase = layers * t["block_input"] + t["head"] + t["ce_temporaries"]
        block_phase = (layers - 1) * t["block_input"] + t["block"] + t["block_temporaries"]
    else:
        head_phase = layers * t["block"] + t["head"] + t["ce_temporaries"]
        block_phase = layers * t["block"] + t["block_temporaries"]
    per_token = max(head_phase, block_phase) + t["stem"]
    # cos/sin tables of (seq_len, head_dim), in the residual dtype, shared by all blocks.
    rope = 2 * shape.seq_len * shape.head_dim * b.residual
    per_item = per_token * shape.seq_len
    return round(per_item * micro_batch_size + rope), per_item
