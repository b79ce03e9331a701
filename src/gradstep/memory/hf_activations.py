"""Activation bytes of one micro-batch of a Hugging Face decoder (an :class:`HFShape`).

The terms follow transformers 5's modelling code tensor by tensor, as autograd saves them
(``tests/memory/test_hf_activations.py`` checks the sum against ``saved_tensors_hooks`` for
every family, in float32, under bf16 autocast and with bf16 parameters, with and without
LoRA). What differs from the demo GPT (:mod:`gradstep.memory.activations`):

* HF's RMSNorm computes in float32: it keeps a float32 copy of its input (the input itself
  when that is float32), the rsqrt per token, and, when its weight trains, the normalised
  input; LayerNorm keeps its input, mean and rstd.
* Under autocast every linear casts its (float32) input itself: q, k and v each keep their
  own low-precision copy of the same normalised input; a fused q/k/v keeps one.
* A frozen linear keeps no input (LoRA): only a trainable weight needs it. A LoRA adapter's
  ``lora_A`` keeps it instead (its own cast under autocast; with LoRA dropout the dropped
  copy and the mask), and ``lora_B`` keeps ``A``'s rank-wide output.
* SDPA keeps q, k, v (v a view of the fused q/k/v output in Phi-3 and GPT-NeoX, so all of
  it), its output and a float32 logsumexp per head; RoPE keeps only its cos/sin tables,
  once for all layers.
* MoE layers (grouped-mm experts) route ``top_k`` copies of every token through the
  experts, which run in the parameters' dtype (transformers does not autocast them); the
  router keeps its float32 softmax, the top-k indices and three permutations.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .activations import _Bytes, chunk_bytes, chunked_head_terms, packed_terms
from .hf_shape import Linear

if TYPE_CHECKING:
    from .hf_shape import HFShape

__all__ = ["chunks_loss", "hf_activations", "hf_per_token_terms"]

_FP32 = 4
_INT64 = 8


class _Terms:
    """Per-token bytes of one layer, by the sizes of its dtypes."""

    def __init__(self, shape: HFShape, b: _Bytes) -> None:
        self.s, self.b = shape, b
        self.e_r, self.e_c = b.residual, b.compute

    def trains(self) -> bool:
        """Whether the base weights train (norms, routers, experts, linears): not under
        LoRA, which freezes them."""
        return not self.s.lora

    def saves(self, lin: Linear) -> bool:
        return self.trains() or self.s.targeted(lin)

    def read_by(
        self, width: int, e_in: int, readers: list[Linear], kept: bool = False, grad: bool = True
    ) -> float:
        """What the linears reading one tensor (``width`` wide, ``e_in`` bytes) keep of it.

        Under autocast (``e_in`` above the compute size) each keeping linear casts its own
        copy; otherwise the tensor itself is kept once (nothing more when ``kept``: another
        op keeps it already). A LoRA adapter keeps through ``lora_A`` (after its dropout:
        the dropped copy, and the mask when the input needs a gradient, ``grad``), and
        ``lora_B`` keeps A's rank-wide output.
        """
        cast = e_in != self.e_c
        adapters = [lin for lin in readers if self.s.targeted(lin)]
        # PEFT casts an adapter's input to the adapter's dtype (float32 over a bf16 base),
        # which autocast casts back: a copy per adapter.
        recast = e_in != self.b.param and not cast
        keepers = [lin for lin in readers if self.saves(lin) and not (recast and lin in adapters)]
        dropout = self.s.lora_dropout > 0
        direct = [lin for lin in keepers if not (dropout and lin in adapters)]
        if cast:
            total = len(keepers) * width * self.e_c
        else:
            total = width * e_in if direct and not kept else 0
        for _ in adapters:
            total += self.s.lora_rank * self.e_c + (width * self.e_c if recast else 0)
            if dropout:
                total += (width * e_in if grad else 0) + (0 if cast or recast else width * e_in)
        return total

    def rms(self, width: int, e_in: int, groups: int = 1) -> tuple[float, int]:
        """(bytes, output dtype size) of HF's RMSNorm: a float32 copy of the input (the input
        itself if float32), rsqrt per group, and the normalised input when the weight trains;
        its output is in the wider of the input's and the weight's dtype."""
        kept = width * _FP32 + groups * _FP32 + (width * e_in if self.trains() else 0)
        return kept, max(e_in, self.e_r)

    def norm(self, width: int) -> tuple[float, int]:
        """A pre-norm on the residual stream: RMSNorm, or LayerNorm (input, mean, rstd)."""
        if self.s.norm == "layer":
            return width * self.e_r + 2 * self.e_r, self.e_r
        return self.rms(width, self.e_r)


def _attention(t: _Terms, e_in: int, grad: bool) -> float:
    """Attention from its normalised input (dtype size ``e_in``; ``grad``: whether it
    needs a gradient) to the out-projection's input."""
    s, e_c = t.s, t.e_c
    linears = s.attention_linears()
    reads = [lin for lin in linears if lin.reads == "attn_in"]
    total = t.read_by(s.d_model, e_in, reads, grad=grad)
    if s.family == "olmoe":
        total += t.rms(s.q_width, e_c)[0] + t.rms(s.kv_width, e_c)[0]
    if s.family == "qwen3":
        total += t.rms(s.q_width, e_c, s.n_head)[0] + t.rms(s.kv_width, e_c, s.n_kv_head)[0]
    fused = s.family in ("phi3", "gpt_neox")
    v = (s.q_width + 2 * s.kv_width) if fused else s.kv_width
    # SDPA: q, k, v (v a view of a fused projection: the whole of it), output, logsumexp.
    total += (2 * s.q_width + s.kv_width + v) * e_c + s.n_head * _FP32
    # After a fused projection SDPA's output is laid out so that the out-projection's
    # reshape copies it; otherwise it reads the output SDPA keeps.
    out = [lin for lin in linears if lin.reads == "attn_out"]
    total += t.read_by(s.q_width, e_c, out, kept=not fused)
    if s.dropout:
        total += s.d_model * e_c  # the residual branch's dropout mask (input dtype, CPU)
    return total


def _mlp(t: _Terms, layer: int, e_in: int) -> float:
    """A dense MLP, or a MoE layer (router, experts, shared expert), from its input."""
    s, e_c = t.s, t.e_c
    linears = s.mlp_linears(layer)
    reads = [lin for lin in linears if lin.reads == "mlp_in"]
    if s.is_moe(layer):
        reads.append(Linear("mlp.gate", s.experts, s.d_model, False, "mlp_in"))  # router
    total = t.read_by(s.d_model, e_in, reads)
    hidden = {lin.reads: lin for lin in linears if lin.reads.endswith("hidden")}
    if s.is_moe(layer):
        total += _experts(t)
        if s.shared_ff:
            total += 3 * s.shared_ff * e_c + t.read_by(s.shared_ff, e_c, [hidden["shared_hidden"]])
            total += s.d_model * e_c + e_c  # shared output and its sigmoid gate
        return total
    if s.family == "opt":  # ReLU keeps its output, which fc2 reads
        total += s.d_ff * e_c + t.read_by(s.d_ff, e_c, [hidden["mlp_hidden"]], kept=True)
    else:  # GELU's input; or gate, act(gate), up; and what the down-projection reads
        total += (1 if s.family == "gpt_neox" else 3) * s.d_ff * e_c
        total += t.read_by(s.d_ff, e_c, [hidden["mlp_hidden"]])
    if s.dropout:
        total += s.d_model * e_c
    return total


def _experts(t: _Terms) -> float:
    """Routing and grouped-mm experts (in the parameters' dtype, not autocast), per token:
    the float32 softmax and top-k indices, then per routed copy the permutations, the
    routing weight, gate_up's output and its activation, and the down output (the routing
    weight's gradient needs it); and, when the experts' weights get a gradient, their input
    and the product."""
    s, e_r = t.s, t.e_r
    d, fe, k = s.d_model, s.expert_ff, s.top_k
    routed = 3 * _INT64 + t.e_c + 3 * fe * e_r + d * e_r
    if t.trains() or _expert_adapters(s):
        routed += d * e_r + fe * e_r
    return s.experts * _FP32 + k * _INT64 + k * routed


def _expert_adapters(s: HFShape) -> bool:
    """PEFT's adapters on the 3-D expert tensors: its ParamWrapper adds the adapter to the
    whole tensor, so every forward materialises (and keeps) the adapted experts."""
    return bool(s.lora and (s.expert_lora[0] or s.expert_lora[1]))


def _layer(t: _Terms, layer: int) -> float:
    """One decoder layer. Under LoRA the first layer's input (a frozen embedding's output)
    needs no gradient: its first norm keeps nothing (GPT-NeoX: both, parallel)."""
    s = t.s
    frozen_input = s.lora and layer == 0
    first, e_a = t.norm(s.d_model)
    second, e_m = t.norm(s.d_model)
    if s.family == "gpt_neox":  # both norms read the same input: it is kept once
        second -= s.d_model * t.e_r
    mlp = _mlp(t, layer, e_m)
    if frozen_input:
        first = 0
        if s.family == "gpt_neox":  # the MLP reads the frozen input too
            second = 0
            mlp = mlp if any(s.targeted(lin) for lin in s.mlp_linears(layer)) else 0
    return first + second + _attention(t, e_a, not frozen_input) + mlp


def _lm_head(shape: HFShape) -> Linear:
    return Linear("lm_head", shape.vocab_size, shape.d_model, False, "head")


def chunks_loss(shape: HFShape, loss_chunk_tokens: int) -> bool:
    """Whether ``causal_lm_loss(chunk_tokens=N)`` chunks this model's loss: N is not 0 and
    its head is not LoRA-adapted (:func:`gradstep.hf.chunkable`'s refusal)."""
    return bool(loss_chunk_tokens) and not (shape.lora and shape.targeted(_lm_head(shape)))


def hf_per_token_terms(shape: HFShape, b: _Bytes, loss_chunk_tokens: int = 0) -> dict[str, float]:
    """Activation bytes per token: ``blocks`` (all layers), ``block`` (the largest layer),
    ``head``, ``stem`` (kept from the embedding to the end), ``block_input``, and the
    backward's ``ce_temporaries`` and
    ``block_temporaries`` (as :func:`gradstep.memory.activations.per_token_terms`; with a
    chunked loss, :func:`gradstep.memory.activations.chunked_head_terms`)."""
    t = _Terms(shape, b)
    layers = [_layer(t, layer) for layer in range(shape.n_layer)]
    final, e_h = t.norm(shape.d_model)
    lm_head = _lm_head(shape)
    ids = _INT64 * ((1 if t.trains() else 0) * (2 if shape.positions else 1) + 1)
    logits = t.read_by(shape.d_model, e_h, [lm_head]) + shape.vocab_size * _FP32
    head = final + logits + ids
    # GPT-NeoX drops out its embedding too (hidden_dropout): a mask kept to the end.
    stem = shape.d_model * t.e_r if shape.family == "gpt_neox" and shape.dropout else 0
    ff = shape.top_k * shape.expert_ff + shape.shared_ff if shape.experts else shape.d_ff
    terms = {
        "blocks": sum(layers),
        "block": max(layers),
        "head": head,
        "stem": stem,
        "block_input": shape.d_model * t.e_r,
        "ce_temporaries": 2 * shape.vocab_size * _FP32,
        "block_temporaries": shape.d_model * t.e_r + 2 * ff * t.e_c,
    }
    if chunks_loss(shape, loss_chunk_tokens):
        terms = chunked_head_terms(terms, shape.d_model, e_h, t.e_r, logits)
    return terms


def hf_activations(
    shape: HFShape,
    b: _Bytes,
    micro_batch_size: int,
    checkpointing: bool,
    loss_chunk_tokens: int = 0,
    packed: bool = False,
) -> tuple[int, float]:
    """(peak activation bytes, bytes per item) of one micro-batch, as
    :func:`gradstep.memory.activations.activations` for the demo GPT: without
    checkpointing everything saved plus the loss's or the top block's backward
    temporaries; with it, every layer's input plus one recomputed layer.
    ``loss_chunk_tokens=N``: ``causal_lm_loss(chunk_tokens=N)`` (:func:`chunks_loss`), one
    chunk's logits in the head phase instead of the whole micro-batch's. ``packed``: rows of
    ``--packing`` (:func:`gradstep.memory.activations.packed_terms`)."""
    t = hf_per_token_terms(shape, b, loss_chunk_tokens)
    layers = shape.n_layer
    if packed:
        rope = 2 * 2 * math.ceil(shape.rotary_dim / 2) * b.residual
        t = packed_terms(t, shape.seq_len, b.compute, rope, layers)
    if checkpointing:
        head_phase = layers * t["block_input"] + t["head"] + t["ce_temporaries"]
        block_phase = (layers - 1) * t["block_input"] + t["block"] + t["block_temporaries"]
    else:
        head_phase = t["blocks"] + t["head"] + t["ce_temporaries"]
        block_phase = t["blocks"] + t["block_temporaries"]
    per_item = (max(head_phase, block_phase) + t["stem"]) * shape.seq_len
    if not chunks_loss(shape, loss_chunk_tokens):
        return round(per_item * micro_batch_size + _per_batch(shape, b, packed)), per_item
    items = micro_batch_size * shape.seq_len
    head_grad = not shape.lora  # LoRA freezes the base, the head included
    fixed = chunk_bytes(
        shape.vocab_size, shape.d_model, loss_chunk_tokens, items, b.compute, b.unsharded, head_grad
    )
    peak = max(head_phase * items + fixed, block_phase * items) + t["stem"] * items
    return round(peak + _per_batch(shape, b, packed)), per_item


def _per_batch(shape: HFShape, b: _Bytes, packed: bool = False) -> int:
    """Bytes that do not grow with the micro-batch: RoPE's cos/sin tables (seq_len x the
    rotated dims, rounded up to pairs, in the residual dtype), computed once per forward
    and kept once for all layers (packed rows: each row's own, in the per-token terms);
    per MoE layer grouped-mm's int32 offsets and, with adapters on the experts, the
    adapted expert tensors."""
    rope = 0 if packed else 2 * shape.seq_len * 2 * math.ceil(shape.rotary_dim / 2) * b.residual
    moe_layers = sum(shape.is_moe(layer) for layer in range(shape.n_layer))
    moe = shape.experts * 4  # grouped-mm's int32 offsets
    if _expert_adapters(shape):
        moe += 3 * shape.experts * shape.d_model * shape.expert_ff * b.residual
    return rope + moe_layers * moe


def hf_saved_bytes(shape: HFShape, b: _Bytes, rows: int) -> int:
    """Bytes one forward saves for backward (no temporaries): what the tests compare with
    autograd's saved tensors."""
    t = hf_per_token_terms(shape, b)
    per_token = t["blocks"] + t["head"] + t["stem"]
    return round(per_token * shape.seq_len * rows + _per_batch(shape, b))
