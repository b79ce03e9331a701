"""Analytic memory model of one training step of a decoder transformer, per device.

The model counts the tensors that are alive at the two moments a step peaks, from the
shapes alone (before anything is allocated):

* the **backward peak**: every activation the forward pass saved, the model states, and the
  gradient temporaries of the first backward operations (the cross-entropy's, or, with
  activation checkpointing, a recomputed block's);
* the **optimizer-step peak**: model states, full gradients and the optimizer's temporaries.

``total = fixed + max(backward peak, step peak)``. Each component field of
:class:`MemoryEstimate` is the most of that kind alive at any point of the step, so the
fields may add up to more than ``total`` (gradients, say, are complete only at the step).

Activation terms were derived for ``gradstep_demo.model.GPT`` (pre-norm LayerNorm blocks,
fused SDPA attention, rotary q/k, GELU MLP, tied head) with ``gradstep.token_loss``, and
checked tensor by tensor against what autograd saves (``saved_tensors_hooks``) and against
the CPU allocator's live bytes (profiler memory events): the formula matches both to < 1%
for fp32, bf16 and fp32-with-bf16-autocast. Korthikanti et al. (2022, "Reducing Activation
Recomputation in Large Transformer Models") is the template; the differences are what this
model keeps: RoPE's rotated q and k (+2d), no s^2 score matrix with fused attention (CPU
flash and CUDA flash/efficient keep only a logsumexp per head and token; with dropout on
CPU torch takes the math path, which keeps three s^2 matrices), dropout masks in the
input's dtype, and an fp32 ``(tokens, vocab)`` log-softmax for the loss
(:mod:`gradstep.memory.activations`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .activations import ATTENTION, _Bytes, activations, per_token_terms
from .hf_activations import hf_activations
from .hf_shape import HFShape
from .states import (
    OPTIMIZER_STATES,
    _fsdp_unsharded,
    _grads_in_backward,
    _model_states,
    _numel,
)

__all__ = [
    "HFShape",
    "MemoryEstimate",
    "Shape",
    "TransformerShape",
    "estimate_step_memory",
    "per_token_terms",
]


@dataclass(frozen=True)
class TransformerShape:
    """Dimensions of a pre-norm decoder transformer (the demo GPT's layout by default).

    Parameter tensors per block: ``qkv (3d, d)``, ``attn out (d, d)``, ``fc (d_ff, d)``,
    ``mlp out (d, d_ff)`` (no biases, ``linear_bias=False``), and ``norms_per_block``
    LayerNorms of ``(d,)`` weight and bias. Outside the blocks: the embedding ``(V, d)``, the
    final norm and, unless ``tied_embeddings``, a separate head ``(V, d)``.
    """

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    d_ff: int | None = None
    tied_embeddings: bool = True
    norms_per_block: int = 2
    linear_bias: bool = False
    norm_bias: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )

    @classmethod
    def from_gpt_config(cls, cfg: object, seq_len: int | None = None) -> TransformerShape:
        """The shape of a ``gradstep_demo.model.GPTConfig`` (``seq_len`` defaults to its max)."""
        d = cfg.d_model  # type: ignore[attr-defined]
        return cls(
            n_layer=cfg.n_layer,  # type: ignore[attr-defined]
            d_model=d,
            n_head=cfg.n_head,  # type: ignore[attr-defined]
            vocab_size=cfg.vocab_size,  # type: ignore[attr-defined]
            seq_len=seq_len or cfg.max_seq_len,  # type: ignore[attr-defined]
            d_ff=cfg.mlp_ratio * d,  # type: ignore[attr-defined]
            tied_embeddings=cfg.tie_weights,  # type: ignore[attr-defined]
        )

    @property
    def ffn(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def all_tensors(self) -> list[tuple[int, ...]]:
        """Every parameter tensor's shape (a tied head once)."""
        return self.block_tensors() * self.n_layer + self.other_tensors()

    def trainable_tensors(self) -> list[tuple[int, ...]]:
        """Every parameter trains (the demo GPT has no frozen part)."""
        return self.all_tensors()

    def head_and_block_trainable(self) -> list[tuple[int, ...]]:
        return self.other_tensors() + self.block_tensors()

    @property
    def trainable_params(self) -> int:
        return self.params

    def block_tensors(self) -> list[tuple[int, ...]]:
        """Parameter shapes of one block (FSDP2 shards each along dim 0)."""
        d, f = self.d_model, self.ffn
        linears = [(3 * d, d), (d, d), (f, d), (d, f)]
        out: list[tuple[int, ...]] = list(linears)
        if self.linear_bias:
            out += [(rows,) for rows, _ in linears]
        out += [(d,)] * (self.norms_per_block * (2 if self.norm_bias else 1))
        return out

    def other_tensors(self) -> list[tuple[int, ...]]:
        """Parameter shapes outside the blocks: embedding, final norm, untied head."""
        v, d = self.vocab_size, self.d_model
        out: list[tuple[int, ...]] = [(v, d)] + [(d,)] * (2 if self.norm_bias else 1)
        return out if self.tied_embeddings else [*out, (v, d)]

    def matmul_numel(self, blocks: int | None = None) -> int:
        """Weights that go through a matmul (what autocast casts): ``blocks`` blocks + head."""
        d, f, v = self.d_model, self.ffn, self.vocab_size
        per_block = 3 * d * d + d * d + 2 * f * d
        return per_block * (self.n_layer if blocks is None else blocks) + v * d

    @property
    def block_params(self) -> int:
        return _numel(self.block_tensors())

    @property
    def params(self) -> int:
        """Unique parameters (a tied head counted once)."""
        return self.n_layer * self.block_params + _numel(self.other_tensors())


Shape = TransformerShape | HFShape
"""What :func:`estimate_step_memory` models: the demo GPT, or a Hugging Face decoder."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one training step (see the module docstring for ``total``)."""

    params: int
    grads: int
    """Gradients at the optimizer step (param dtype, this device's shard)."""
    accum_buffers: int
    """gradstep's float32 accumulation buffers of bf16/fp16 parameters (kept between steps)."""
    optimizer: int
    activations: int
    """Peak of activation memory of one micro-batch: saved tensors + backward temporaries."""
    unsharded_block: int
    """FSDP2: all-gathered parameters alive at once (root group + current and prefetched
    block) and one block's gradient buffers for the reduce-scatter."""
    fixed: int
    total: int
    grads_in_backward: int = 0
    """Gradient memory already alive at the backward peak (0 before the first gradient)."""
    weight_copies: int = 0
    """autocast's low-precision copies of matmul weights, kept by the graph for backward."""
    step_temporaries: int = 0
    """The optimizer step's own temporaries (AdamW's sqrt(v) denominators)."""
    backward_peak: int = 0
    step_peak: int = 0
    activations_per_item: float = 0.0
    """Slope of ``activations`` in micro-batch items (one sequence of ``seq_len``)."""

    def as_dict(self) -> dict:
        return asdict(self)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_args(optimizer: str, micro_batch_size: int, world_size: int) -> None:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if micro_batch_size < 1 or world_size < 1:
        raise ValueError(
            f"micro_batch_size and world_size must be >= 1, got {micro_batch_size}, {world_size}"
        )


def estimate_step_memory(
    shape: Shape,
    micro_batch_size: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    accum_dtype: torch.dtype | None = None,
    world_size: int = 1,
    sharded: bool = False,
    activation_checkpointing: bool = False,
    fixed_bytes: int = 0,
    accum_steps: int | None = None,
    sync_each_micro_batch: bool = False,
    foreach: bool = False,
    dropout: float = 0.0,
    attention: str = "fused",
    frozen_dtype: torch.dtype | None = None,
) -> MemoryEstimate:
    """Predicted bytes per device of one ``Stepper.step`` with micro-batches of
    ``micro_batch_size`` sequences of ``shape.seq_len`` tokens.

    ``compute_dtype``: autocast's dtype (None: the parameter dtype). With ``sharded`` (FSDP2
    over ``world_size`` ranks) it is the ``MixedPrecisionPolicy`` parameter dtype, as
    ``gradstep.parallel.prepare_model(precision="bf16")`` sets it: the all-gathered
    parameters, and so the whole forward, are in that dtype. ``accum_dtype``: None means
    float32 buffers for bf16/fp16 parameters (what the Stepper does; not with FSDP2, which
    accumulates itself). ``accum_steps``: micro-batches per step, None when unknown (then
    gradients are counted as alive at the backward peak, the worst case). ``foreach``:
    whether the optimizer uses its foreach implementation (torch's default on CUDA; on CPU
    it loops over parameters). ``fixed_bytes``: the runtime's own cost (CUDA context is not
    in ``max_memory_allocated``; on CPU, interpreter + torch: measure it or probe it).
    ``dropout``: the model's dropout probability (masks are kept when it is > 0);
    ``attention``: ``"fused"`` or ``"math"`` (what torch runs on CPU with attention
    dropout: s^2 matrices per head), see :data:`gradstep.memory.activations.ATTENTION`.
    Both are the demo GPT's: an :class:`HFShape` carries its own dropout.

    ``shape`` is a :class:`TransformerShape` (the demo GPT) or an :class:`HFShape` (a Hugging
    Face decoder, :func:`gradstep.memory.hf_config.from_hf_config`). ``param_dtype`` is the
    dtype of the trainable parameters; ``frozen_dtype`` that of frozen ones (LoRA's base; None:
    ``param_dtype``), which is then also the dtype the forward's activations start in.
    """
    _check_args(optimizer, micro_batch_size, world_size)
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    e_p = _size(param_dtype)
    e_f = _size(frozen_dtype) if frozen_dtype is not None else e_p
    e_base = e_f if shape.trainable_params < shape.params else e_p
    e_c = _size(compute_dtype) if compute_dtype is not None else e_base
    e_u = e_c if sharded else e_base
    sizes = _Bytes(param=e_p, compute=e_c, residual=e_u, unsharded=e_u, frozen=e_f)
    shards = sharded and world_size > 1
    if accum_dtype is None and param_dtype in (torch.float16, torch.bfloat16) and not sharded:
        accum_dtype = torch.float32
    buffered = accum_dtype is not None and accum_dtype != param_dtype and not sharded
    states = _model_states(shape, sizes, world_size if shards else 1, optimizer, foreach)
    params, grads, opt, step_tmp = states
    accum = shape.trainable_params * _size(accum_dtype) if buffered and accum_dtype else 0
    if isinstance(shape, HFShape):
        acts, per_item = hf_activations(shape, sizes, micro_batch_size, activation_checkpointing)
    else:
        acts, per_item = activations(
            shape, sizes, micro_batch_size, activation_checkpointing, dropout > 0, attention
        )
    g_bwd = _grads_in_backward(
        shape,
        sizes,
        sharded=shards,
        world=world_size,
        accum_steps=accum_steps,
        sync_each_micro_batch=sync_each_micro_batch,
        checkpointing=activation_checkpointing,
        buffered=buffered,
    )
    reduces = accum_steps == 1 or sync_each_micro_batch
    unsharded = _fsdp_unsharded(shape, sizes, reduces) if shards else 0
    # Without checkpointing every block's cast weights are saved; with it only the head's
    # and the recomputed block's exist at once. LoRA's adapters may be float32 over a bf16
    # base: each part is cast when its dtype is not the compute dtype.
    blocks = 1 if activation_checkpointing else None
    lora = isinstance(shape, HFShape) and shape.lora
    copies = shape.matmul_numel(blocks, "base") * e_c if lora and e_c != e_u else 0
    copies += shape.matmul_numel(blocks, "adapters") * e_c if lora and e_c != e_p else 0
    if not lora and e_c != e_u:
        copies = shape.matmul_numel(blocks) * e_c
    backward = params + g_bwd + accum + opt + unsharded + copies + acts
    step = params + grads + accum + opt + step_tmp
    return MemoryEstimate(
        params=params,
        grads=grads,
        accum_buffers=accum,
        optimizer=opt,
        activations=acts,
        unsharded_block=unsharded,
        fixed=fixed_bytes,
        total=fixed_bytes + max(backward, step),
        grads_in_backward=g_bwd,
        weight_copies=copies,
        step_temporaries=step_tmp,
        backward_peak=backward,
        step_peak=step,
        activations_per_item=per_item,
    )
