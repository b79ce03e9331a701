"""Model states of one step per device: parameters, gradients, optimizer state, and the
gradient and FSDP2 buffers alive at the backward peak.

Split out of :mod:`gradstep.memory.model` (which adds activations and the step's peaks).
Only trainable parameters have gradients and optimizer state: LoRA's frozen base is held
once, in its own dtype (``_Bytes.frozen``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .activations import _Bytes
from .shape import _numel

if TYPE_CHECKING:
    from ..parallel.layout import Layout
    from .shape import Shape

__all__ = ["OptimizerMemory"]


@dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer holds besides parameters and gradients, counted in tensors of its
    trainable parameters' sizes (in the parameters' dtype, as torch keeps them).

    ``states_per_param``: kept between steps (AdamW's ``exp_avg`` and ``exp_avg_sq``: 2; a
    momentum buffer: 1; plain SGD: 0). ``step_params``: temporaries its ``step()`` holds at
    once, in copies of every trainable parameter (AdamW with foreach: 1; LAMB, which needs
    every update before its trust ratios: 1). ``step_largest``: temporaries the size of the
    largest trainable tensor (AdamW's loop: 2, ``sqrt(v)`` and its quotient; LARS: 1).

    :meth:`named` gives the optimizers the library knows by name, :meth:`of` reads an
    optimizer object; any other optimizer is described by these three numbers.
    """

    states_per_param: float
    step_params: float = 0
    step_largest: float = 0

    def __post_init__(self) -> None:
        for name in ("states_per_param", "step_params", "step_largest"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"OptimizerMemory.{name} must be a number >= 0, got {value!r}")

    @classmethod
    def named(cls, name: str, foreach: bool = False) -> OptimizerMemory:
        """One of :data:`NAMED_OPTIMIZERS`: torch's AdamW/Adam and SGD (with momentum:
        ``sgd_momentum``), gradstep's LARS and LAMB, or ``none``. ``foreach``: AdamW/Adam's
        foreach implementation (torch's default on CUDA; on CPU it loops over parameters)."""
        if name not in NAMED_OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(NAMED_OPTIMIZERS)}, got {name!r}")
        if name in ("adamw", "adam"):
            return cls(2, step_params=1) if foreach else cls(2, step_largest=2)
        return NAMED_OPTIMIZERS[name]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerMemory:
        """The memory of ``optimizer`` (torch's Adam, AdamW or SGD, gradstep's LARS or LAMB),
        from its class and settings: AMSGrad keeps a third state, SGD without momentum none.
        A ``foreach`` left to torch (None) is read as the loop, what torch runs on CPU."""
        from ..optim import LAMB, LARS  # the optimizers' module needs nothing from here

        groups = optimizer.param_groups
        if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
            amsgrad = any(g.get("amsgrad") for g in groups)
            named = cls.named("adamw", foreach=any(g.get("foreach") for g in groups))
            return dataclasses.replace(named, states_per_param=2 + amsgrad)
        if isinstance(optimizer, torch.optim.SGD):
            momentum = any(g.get("momentum") for g in groups)
            return cls.named("sgd_momentum" if momentum else "sgd")
        for kind, name in ((LAMB, "lamb"), (LARS, "lars")):
            if isinstance(optimizer, kind):
                return cls.named(name)
        raise ValueError(
            f"the memory of a {type(optimizer).__name__} is not known: describe it as "
            "gradstep.memory.OptimizerMemory(states_per_param=N, step_params=..., "
            "step_largest=...)"
        )


NAMED_OPTIMIZERS = {
    "adamw": OptimizerMemory(2, step_largest=2),
    "adam": OptimizerMemory(2, step_largest=2),
    "lamb": OptimizerMemory(2, step_params=1, step_largest=2),
    "lars": OptimizerMemory(1, step_largest=1),
    "sgd_momentum": OptimizerMemory(1),
    "sgd": OptimizerMemory(0),
    "none": OptimizerMemory(0),
}
"""The optimizers :meth:`OptimizerMemory.named` knows (AdamW/Adam: without foreach)."""

_FP32 = 4


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
    shape: Shape, b: _Bytes, world: int, optimizer: OptimizerMemory
) -> tuple[int, int, int, int]:
    """(params, grads, optimizer state, optimizer-step temporaries) on this device.

    ``world`` > 1: FSDP2 shards, per tensor, dim 0 padded to a multiple of ``world``.
    Optimizer state and temporaries are in tensors of the trainable parameters' sizes
    (:class:`OptimizerMemory`). Frozen parameters (LoRA's base) have no gradient, optimizer
    state or step temporaries, and are held in their own dtype (``b.frozen``).
    """
    count = (lambda shapes: _shard_numel(shapes, world)) if world > 1 else _numel
    trained = shape.trainable_tensors()
    grads = count(trained)
    frozen = count(shape.all_tensors()) - grads  # FSDP2 pads per tensor: shard both alike
    params = grads * b.param + frozen * (b.frozen or b.param)
    largest = max(math.prod(s) for s in trained)
    step_tmp = round(optimizer.step_params * grads + optimizer.step_largest * largest)
    opt = round(optimizer.states_per_param * grads)
    return params, grads * b.param, opt * b.param, step_tmp * b.param


def _mesh(shape: Shape, world: int, sharded: bool, layout: Layout | None) -> tuple[Shape, int]:
    """(the shape one rank holds, the ranks FSDP2 shards over) on ``layout``'s mesh of
    ``world`` ranks (None: ``Layout()``, every rank one data-parallel shard)."""
    from ..parallel.layout import Layout

    own = getattr(shape, "tp", None)  # a TransformerShape's; an HFShape has none
    if layout is None:
        layout = Layout()
    if not isinstance(layout, Layout):
        raise ValueError(
            f"layout must be a gradstep.parallel.Layout or None, got {type(layout).__name__}"
        )
    sizes = layout.resolve(world)  # a ValueError naming the sizes that do not fit
    tp, replicas = sizes.tp, sizes.dp_replicate
    if (tp > 1 or replicas > 1) and not sharded:
        raise ValueError(
            f"layout={layout!r} models FSDP2 on a multi-dimensional mesh: it needs sharded=True"
        )
    if tp > 1 and own not in (None, 1, tp):
        raise ValueError(f"tp={tp}, but the shape is already one of {own} tensor-parallel ranks")
    if tp > 1:
        if own is None:
            raise ValueError(
                "tp is modelled for a TransformerShape (the demo GPT's layout) only, got "
                f"{type(shape).__name__}"
            )
        shape = dataclasses.replace(shape, tp=tp)
    return shape, world // (max(tp, own or 1) * replicas)
