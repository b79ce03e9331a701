"""Model states of one step per device: parameters, gradients, optimizer state, and the
gradient and FSDP2 buffers alive at the backward peak.

Split out of :mod:`gradstep.memory.model` (which adds activations and the step's peaks).
Only trainable parameters have gradients and optimizer state: LoRA's frozen base is held
once, in its own dtype (``_Bytes.frozen``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .activations import _Bytes

if TYPE_CHECKING:
    from .model import Shape

__all__: list[str] = []

OPTIMIZER_STATES = {
    "adamw": 2,
    "adam": 2,
    "lamb": 2,
    "lars": 1,
    "sgd_momentum": 1,
    "sgd": 0,
    "none": 0,
}
"""Tensors of parameter size the optimizer keeps per parameter (in the parameter's dtype:
AdamW's and LAMB's exp_avg and exp_avg_sq, the SGD/LARS momentum buffer)."""

_FP32 = 4


def _numel(shapes: Sequence[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def _shard_numel(shapes: Sequence[tuple[int, ...]], world: int) -> int:
    """FSDP2's per-rank storage: dim 0 padded to a multiple of ``world`` and split."""
    return sum(math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes)


def _grads_in_backward(
    shape: Shape,
    b: _Bytes,
    *,
    sharded: bool,
    world: int,
    accum_steps: int | None,
    sync_each_micro_batch: bool,
    checkpointing: bool,
    buffered: bool,
) -> int:
    """Gradient bytes alive at the backward peak.

    The Stepper zeroes gradients to None at the start of a step, so the first micro-batch's
    loss backward (the peak without checkpointing) runs before any gradient exists, and a
    recomputed top block (the peak with it) after the head's and that block's. Later
    micro-batches run with every gradient of the step alive. Accumulation buffers take each
    gradient as it appears and free it, leaving at most the largest tensor's. FSDP2 without
    per-micro-batch sync keeps *unsharded* gradients (its reduce dtype, float32 with the
    bf16 policy) until the last micro-batch reduce-scatters them.
    """
    first_only = accum_steps == 1
    trained = shape.trainable_tensors()
    if buffered:
        return max(math.prod(s) for s in trained) * b.param
    if sharded and not first_only and not sync_each_micro_batch:
        return _numel(trained) * (_FP32 if b.unsharded != b.param else b.param)
    count = _shard_numel if sharded else lambda shapes, _w: _numel(shapes)
    if not first_only:
        return count(trained, world) * b.param
    if not checkpointing:
        return 0
    return count(shape.head_and_block_trainable(), world) * b.param


def _fsdp_unsharded(shape: Shape, b: _Bytes, reduces: bool) -> int:
    """All-gathered parameters alive at once under FSDP2 (and reduce-scatter buffers).

    The root group (embedding, final norm, head) stays unsharded from forward to backward
    (FSDP2 does not reshard the root after forward); blocks are resharded after their
    forward, but the next block's all-gather is issued before the current one is freed, so
    two blocks are unsharded at once. A micro-batch that reduce-scatters also holds one
    block's unsharded gradient and the flat copy it reduce-scatters from.
    """
    root = _numel(shape.other_tensors())
    grads = 2 * shape.block_params * _FP32 if reduces else 0
    return (root + 2 * shape.block_params) * b.unsharded + grads


def _model_states(
    shape: Shape, b: _Bytes, world: int, optimizer: str, foreach: bool
) -> tuple[int, int, int, int]:
    """(params, grads, optimizer state, optimizer-step temporaries) on this device.

    ``world`` > 1: FSDP2 shards, per tensor, dim 0 padded to a multiple of ``world``.
    Temporaries: AdamW with foreach makes one parameter-sized temporary for the whole list,
    its loop two of the largest tensor (sqrt(v) and its quotient by the bias correction) at
    a time; LAMB holds every parameter's update at once (the trust ratios need all norms
    first) plus those two; LARS one weight-decayed gradient at a time. Frozen parameters
    (LoRA's base) have no gradient, optimizer state or step temporaries, and are held in
    their own dtype (``b.frozen``).
    """
    count = (lambda shapes: _shard_numel(shapes, world)) if world > 1 else _numel
    trained = shape.trainable_tensors()
    grads = count(trained)
    frozen = count(shape.all_tensors()) - grads  # FSDP2 pads per tensor: shard both alike
    params = grads * b.param + frozen * (b.frozen or b.param)
    largest = max(math.prod(s) for s in trained)
    step_tmp = {
        "adamw": grads if foreach else 2 * largest,
        "adam": grads if foreach else 2 * largest,
        "lamb": grads + 2 * largest,
        "lars": largest,
    }.get(optimizer, 0)
    opt = OPTIMIZER_STATES[optimizer] * grads
    return params, grads * b.param, opt * b.param, step_tmp * b.param
