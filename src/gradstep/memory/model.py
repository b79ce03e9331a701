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

Activation terms were derived for the decoder :class:`TransformerShape` describes (pre-norm
LayerNorm blocks, fused SDPA attention, rotary q/k, GELU MLP, tied head) with
``gradstep.token_loss``, and checked on the demo's GPT, which has that layout, tensor by
tensor against what autograd saves (``saved_tensors_hooks``) and against the CPU
allocator's live bytes (profiler memory events): the formula matches both to < 1% for fp32,
bf16 and fp32-with-bf16-autocast. Korthikanti et al. (2022, "Reducing Activation
Recomputation in Large Transformer Models") is the template; the differences are what this
model keeps: RoPE's rotated q and k (+2d), no s^2 score matrix with fused attention (CPU
flash and CUDA flash/efficient keep only a logsumexp per head and token; with dropout on
CPU torch takes the math path, which keeps three s^2 matrices), dropout masks in the
input's dtype, and an fp32 ``(tokens, vocab)`` log-softmax for the loss
(:mod:`gradstep.memory.activations`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from .activations import ATTENTION, _Bytes, activations, per_token_terms
from .hf_activations import hf_activations
from .hf_shape import HFShape
from .shape import Shape, TransformerShape
from .states import (
    OptimizerMemory,
    _fsdp_unsharded,
    _grads_in_backward,
    _mesh,
    _model_states,
)

if TYPE_CHECKING:
    from ..parallel.layout import Layout

__all__ = [
    "HFShape",
    "MemoryEstimate",
    "OptimizerMemory",
    "Shape",
    "TransformerShape",
    "estimate_step_memory",
    "per_token_terms",
]


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


def _check_args(micro_batch_size: int, world_size: int, attention: str, chunk: object) -> None:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"loss_chunk_tokens must be an int >= 0, got {chunk!r}")
    if micro_batch_size < 1 or world_size < 1:
        raise ValueError(
            f"micro_batch_size and world_size must be >= 1, got {micro_batch_size}, {world_size}"
        )
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")


def _optimizer_memory(optimizer: str | OptimizerMemory, foreach: bool) -> OptimizerMemory:
    if isinstance(optimizer, OptimizerMemory):
        if foreach:
            raise ValueError(
                "foreach describes a named optimizer's temporaries; an OptimizerMemory gives "
                "its own (step_params, step_largest): leave foreach False"
            )
        return optimizer
    return OptimizerMemory.named(optimizer, foreach)


def _sizes(
    shape: Shape,
    param_dtype: torch.dtype,
    compute_dtype: torch.dtype | None,
    frozen_dtype: torch.dtype | None,
    sharded: bool,
) -> _Bytes:
    """Element sizes: trainable and frozen parameters, compute, the unsharded parameters
    (FSDP2 all-gathers in its compute dtype) and the residual stream."""
    e_p = _size(param_dtype)
    e_f = _size(frozen_dtype) if frozen_dtype is not None else e_p
    e_base = e_f if shape.trainable_params < shape.params else e_p
    e_c = _size(compute_dtype) if compute_dtype is not None else e_base
    e_u = e_c if sharded else e_base
    return _Bytes(param=e_p, compute=e_c, residual=e_u, unsharded=e_u, frozen=e_f)


def _activations(
    shape: Shape,
    sizes: _Bytes,
    mbs: int,
    checkpointing: bool,
    dropout: float,
    attention: str,
    chunk: int = 0,
    packed: bool = False,
) -> tuple[int, float]:
    if isinstance(shape, HFShape):
        return hf_activations(shape, sizes, mbs, checkpointing, chunk, packed)
    return activations(shape, sizes, mbs, checkpointing, dropout > 0, attention, chunk, packed)


def _weight_copies(shape: Shape, sizes: _Bytes, checkpointing: bool) -> int:
    """autocast's cast copies of the matmul weights. Without checkpointing every block's
    are saved; with it only the head's and the recomputed block's exist at once. LoRA's
    adapters may be float32 over a bf16 base: each part is cast when its dtype is not the
    compute dtype."""
    blocks = 1 if checkpointing else None
    e_c, e_u, e_p = sizes.compute, sizes.unsharded, sizes.param
    if isinstance(shape, HFShape) and shape.lora:
        copies = shape.matmul_numel(blocks, "base") * e_c if e_c != e_u else 0
        return copies + (shape.matmul_numel(blocks, "adapters") * e_c if e_c != e_p else 0)
    return shape.matmul_numel(blocks) * e_c if e_c != e_u else 0


def estimate_step_memory(
    shape: Shape,
    micro_batch_size: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    optimizer: str | OptimizerMemory = "adamw",
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
    layout: Layout | None = None,
    loss_chunk_tokens: int = 0,
    packed: bool = False,
) -> MemoryEstimate:
    """Predicted bytes per device of one ``Stepper.step`` with micro-batches of
    ``micro_batch_size`` sequences of ``shape.seq_len`` tokens.

    ``shape``: a :class:`TransformerShape` or an :class:`HFShape` (a Hugging Face decoder,
    :func:`gradstep.memory.hf_config.from_hf_config`). ``param_dtype``/``frozen_dtype``: the
    trainable/frozen parameters' (LoRA's base; None: ``param_dtype``; also the dtype the
    forward's activations start in). ``compute_dtype``: autocast's (None: the parameters');
    with ``sharded`` (FSDP2 over ``world_size`` ranks) the ``MixedPrecisionPolicy``
    parameter dtype ``gradstep.parallel.prepare_model(precision="bf16")`` sets, so the whole
    forward runs in it. ``optimizer``: an :class:`OptimizerMemory`, or a name of
    :meth:`OptimizerMemory.named` (``foreach``: its foreach implementation). ``accum_dtype``:
    None means float32 buffers for bf16/fp16 parameters (the Stepper's; not with FSDP2,
    which accumulates itself). ``accum_steps``: micro-batches per step, None when unknown
    (the worst case: gradients alive at the backward peak, and under FSDP2 the
    reduce-scatter buffers too). ``fixed_bytes``: the runtime's own cost (CUDA context;
    on CPU interpreter + torch: probe it). ``dropout`` and ``attention`` (``"fused"`` or
    ``"math"``: :data:`gradstep.memory.activations.ATTENTION`) are a TransformerShape's.
    ``layout`` (``sharded``; a :class:`gradstep.parallel.Layout`, None: ``Layout()``;
    docs/library/memory.md): ``dp_replicate=R`` (HSDP) and ``tp=N`` (the blocks' matmuls
    split) leave FSDP2 ``world_size / (R x N)`` ranks. ``loss_chunk_tokens=N`` (0: whole
    logits): :func:`gradstep.step.loss.chunked_token_loss`, one chunk's logits at a time.
    ``packed``: rows of several sequences (:func:`~gradstep.memory.activations.packed_terms`).
    """
    _check_args(micro_batch_size, world_size, attention, loss_chunk_tokens)
    shape, shard_ranks = _mesh(shape, world_size, sharded, layout)
    sizes = _sizes(shape, param_dtype, compute_dtype, frozen_dtype, sharded)
    shards = sharded and shard_ranks > 1
    accum = _accum_buffers(shape, param_dtype, accum_dtype, sharded)
    opt_memory = _optimizer_memory(optimizer, foreach)
    states = _model_states(shape, sizes, shard_ranks if shards else 1, opt_memory)
    ckpt, chunk = activation_checkpointing, loss_chunk_tokens
    acts = _activations(shape, sizes, micro_batch_size, ckpt, dropout, attention, chunk, packed)
    held = _held_in_backward(
        shape, sizes, shards, shard_ranks, accum_steps, sync_each_micro_batch, ckpt, accum > 0
    )
    copies = _weight_copies(shape, sizes, activation_checkpointing)
    return _estimate(states, accum, acts, held, copies, fixed_bytes)


def _accum_buffers(
    shape: Shape, param_dtype: torch.dtype, accum_dtype: torch.dtype | None, sharded: bool
) -> int:
    """The Stepper's accumulation buffers (None: float32 for bf16/fp16 parameters; FSDP2
    accumulates itself)."""
    if accum_dtype is None and param_dtype in (torch.float16, torch.bfloat16):
        accum_dtype = torch.float32
    if sharded or accum_dtype is None or accum_dtype == param_dtype:
        return 0
    return shape.trainable_params * _size(accum_dtype)


def _held_in_backward(
    shape: Shape,
    sizes: _Bytes,
    shards: bool,
    world: int,
    accum_steps: int | None,
    sync_each_micro_batch: bool,
    checkpointing: bool,
    buffered: bool,
) -> tuple[int, int]:
    """(gradients, FSDP2's unsharded parameters and reduce-scatter buffers) alive at the
    backward peak."""
    grads = _grads_in_backward(
        shape,
        sizes,
        sharded=shards,
        world=world,
        accum_steps=accum_steps,
        sync_each_micro_batch=sync_each_micro_batch,
        checkpointing=checkpointing,
        buffered=buffered,
    )
    # Unknown accumulation may be one micro-batch, which reduce-scatters in its backward.
    reduces = accum_steps in (None, 1) or sync_each_micro_batch
    return grads, _fsdp_unsharded(shape, sizes, reduces) if shards else 0


def _estimate(
    states: tuple[int, int, int, int],
    accum: int,
    acts: tuple[int, float],
    held: tuple[int, int],
    copies: int,
    fixed: int,
) -> MemoryEstimate:
    """The two peaks from their parts: ``fixed + max(backward, step)``."""
    params, grads, opt, step_tmp = states
    (activation_bytes, per_item), (g_bwd, unsharded) = acts, held
    backward = params + g_bwd + accum + opt + unsharded + copies + activation_bytes
    step = params + grads + accum + opt + step_tmp
    return MemoryEstimate(
        params=params,
        grads=grads,
        accum_buffers=accum,
        optimizer=opt,
        activations=activation_bytes,
        unsharded_block=unsharded,
        fixed=fixed,
        total=fixed + max(backward, step),
        grads_in_backward=g_bwd,
        weight_copies=copies,
        step_temporaries=step_tmp,
        backward_peak=backward,
        step_peak=step,
        activations_per_item=per_item,
    )
