"""The global gradient norm: the one place a strategy's gradient layout becomes it.

A strategy declares how its reduced gradient lies on the ranks
(:data:`gradstep.parallel.GRADIENT_LAYOUTS`); this module, and nothing else, turns that
into the norm over every rank and shard:

- ``replicated`` (one process, DDP): this rank's norm is the global one;
- ``dp_sharded`` (FSDP2, HSDP): ``norm**p`` of this rank's shards, times its weight (0 on
  an HSDP replica's copies), summed over the data-parallel ranks. In the step that sum
  rides the tally's one collective (:func:`window_norm` says it is still to be summed);
  the inf-norm needs a max, the strategy's ``all_reduce_max``;
- ``self_reduced`` (FSDP2 + tensor parallel): the strategy's own ``total_norm``.

The norm of the step is taken after backward, or while the last backward runs
(:class:`EarlyNorm`): the post-hoc step reads every gradient twice after backward, once
for the norm and once (read + write) for the multiply that normalises and clips; taking
each gradient's norm as soon as it is final, while it is still in cache, leaves only the
multiply, a third less memory traffic. Where a gradient becomes final is the strategy's
business (:class:`gradstep.parallel.FinalGrads`): on one process when autograd has
accumulated it, under FSDP2 when its reduce-scattered shard is assigned, under DDP when a
bucket's all-reduce completes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..parallel import Capabilities, Strategy
from ..parallel.dtensor import norm32, shard_norm, to_local

__all__ = [
    "NORM_IN_BACKWARD_BYTES",
    "EarlyNorm",
    "combine",
    "decide",
    "global_norm",
    "window_norm",
]

NORM_IN_BACKWARD_BYTES = 32 * 2**20
"""``norm_in_backward="auto"`` takes the norm in backward when the gradients hold at least
this much: too much for a cache to keep between backward and a later pass. Calibrated on a
2-core CPU (BENCHMARKS.md, "Where the norm is taken"); on small models one norm per
parameter costs more than the single pass it replaces."""


def decide(
    mode: bool | str, params: Sequence[nn.Parameter], caps: Capabilities, precision: Any
) -> bool:
    """Whether a Stepper takes the norm in the last backward, decided once: asked for (or
    ``"auto"`` and big enough), the strategy can say where gradients become final, and
    the gradients backpropagated are the final ones (no fp16 loss scale to unscale first,
    no float32 buffers outside ``.grad``)."""
    if mode not in (True, False, "auto"):
        raise ValueError(f"norm_in_backward must be True, False or 'auto'; got {mode!r}")
    if mode == "auto":
        mode = sum(p.numel() * p.element_size() for p in params) >= NORM_IN_BACKWARD_BYTES
    plain = precision.scaler is None and precision.accumulator is None
    return bool(mode) and caps.final_grads is not None and plain


def combine(norms: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of a concatenation from the norms of its parts."""
    dtype = functools.reduce(torch.promote_types, (n.dtype for n in norms))
    stacked = torch.stack([n.to(dtype) for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return torch.linalg.vector_norm(stacked, norm_type)


class EarlyNorm:
    """Norms of the final gradients, recorded during one backward, one per parameter (a
    later record of a parameter replaces the earlier, which happens when a gradient is
    final more than once, e.g. under reentrant checkpointing).

    A parameter the last micro-batch did not use (a branch or an expert that only earlier
    micro-batches took) fires no hook in that backward, yet holds their gradient: its norm
    is taken from ``.grad`` in :meth:`local`, as the pass after backward would.

    They are combined in the parameters' order, not in the order they became final: the
    order of DDP's buckets changes after its first iteration (and again after a resume),
    and a sum in another order rounds differently, which would break a bitwise resume.
    """

    def __init__(self, norm_type: float, params: Sequence[nn.Parameter]) -> None:
        self.norm_type = norm_type
        self.params = list(params)
        self.order = {id(p): i for i, p in enumerate(self.params)}
        self.parts: dict[int, torch.Tensor] = {}
        self.recording: Any = None
        """The strategy's context that records into this during the last backward."""

    @classmethod
    def start(
        cls, caps: Capabilities, params: Sequence[nn.Parameter], norm_type: float
    ) -> EarlyNorm | None:
        """An EarlyNorm recording through the strategy's :class:`FinalGrads` hooks (which
        :func:`decide` found); None when the strategy cannot on this model (then the norm
        is taken after backward)."""
        early = cls(norm_type, params)
        early.recording = caps.final_grads(early.params, early.record)  # type: ignore[misc]
        return None if early.recording is None else early

    def record(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        self.parts[self.order[id(param)]] = norm32(grad, self.norm_type)

    def local(self, device: torch.device) -> torch.Tensor:
        """The norm over every gradient on this rank: the recorded parts, and the
        gradients of parameters the last backward did not reach."""
        missing = len(self.parts) < len(self.params)  # usually none: no loop
        for i, p in enumerate(self.params if missing else ()):
            if i not in self.parts and p.grad is not None:
                self.record(p, to_local(p.grad))
        if not self.parts:
            return torch.zeros((), device=device)
        return combine([self.parts[i] for i in sorted(self.parts)], self.norm_type)


def window_norm(
    strategy: Strategy,
    caps: Capabilities,
    grads: Sequence[torch.Tensor],
    early: EarlyNorm | None,
    norm_type: float,
) -> tuple[torch.Tensor, bool]:
    """This rank's part of the window's global norm, and whether its ``norm_type``-th power
    is still to be summed over the data-parallel ranks (the tally's collective does that):
    the step's norm without a collective of its own, except where a max or the strategy's
    own reduction is needed."""
    layout = strategy.gradient_layout
    if layout == "self_reduced":
        return caps.total_norm(grads, norm_type), False  # type: ignore[misc]
    if early is not None:
        local = early.local(grads[0].device if grads else torch.device("cpu"))
    elif layout == "replicated":  # plain tensors: torch's own norm, no DTensor view needed
        local = _plain_norm(grads, norm_type)
    else:
        local = shard_norm(grads, norm_type)
    if layout == "replicated":
        return local, False
    if math.isinf(norm_type):
        return strategy.all_reduce_max(local), False
    return local * caps.norm_weight, True


def global_norm(
    strategy: Strategy, caps: Capabilities, grads: Sequence[torch.Tensor], norm_type: float
) -> torch.Tensor:
    """The global norm of ``grads`` over every rank and shard, with its own collective
    (policies that edit the gradient in place are measured again with this)."""
    local, summed = window_norm(strategy, caps, grads, None, norm_type)
    if not summed:
        return local
    power = strategy.all_reduce_sum(local.to(torch.float64).reshape(1) ** norm_type)
    return power.reshape(()) ** (1.0 / norm_type)


def _plain_norm(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(list(grads), norm_type=norm_type, foreach=None)
