"""The gradient norm taken while the last backward runs, not in a pass after it.

The post-hoc step reads every gradient twice after backward: once for the norm and once
(read + write) for the multiply that normalises and clips. Taking each gradient's norm as
soon as it is final (in the last micro-batch's backward, while it is still in cache) leaves
only the multiply for after backward: a third less memory traffic.

Where a gradient becomes final is the strategy's business: on one process when autograd
has accumulated it (a post-accumulate-grad hook), under FSDP2 when its reduce-scattered
shard is assigned (FSDP2 runs the same hooks on the sharded parameter), under DDP when a
bucket's all-reduce completes (a communication hook). Each strategy that can says so
with ``final_grads(params, record)``; the others keep the post-hoc pass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from ..parallel.base import FinalGrads, Strategy, shard_norm
from ..parallel.dtensor import norm32, to_local

__all__ = [
    "NORM_IN_BACKWARD_BYTES",
    "EarlyNorm",
    "combine",
    "decide",
    "local_part",
]

NORM_IN_BACKWARD_BYTES = 32 * 2**20
"""``norm_in_backward="auto"`` takes the norm in backward when the gradients hold at least
this much: too much for a cache to keep between backward and a later pass. Calibrated on a
2-core CPU (BENCHMARKS.md, "Where the norm is taken"); on small models one norm per
parameter costs more than the single pass it replaces."""


def decide(
    mode: bool | str, params: Sequence[nn.Parameter], strategy: Strategy, precision: Any
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
    return bool(mode) and isinstance(strategy, FinalGrads) and plain


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
        self.hooks: Any = None
        """The strategy's context that records into this during the last backward."""

    @classmethod
    def start(
        cls, enabled: bool, strategy: Strategy, params: Sequence[nn.Parameter], norm_type: float
    ) -> EarlyNorm | None:
        """An EarlyNorm with the hooks of a :class:`FinalGrads` strategy that record into it;
        None when not ``enabled`` (:func:`decide`, which already checked the strategy is
        one) or when the strategy cannot on this model (then the norm is taken after
        backward)."""
        if not enabled:
            return None
        early = cls(norm_type, params)
        early.hooks = cast(FinalGrads, strategy).final_grads(early.params, early.record)
        return None if early.hooks is None else early

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


def local_part(
    strategy: Strategy, grads: Sequence[torch.Tensor], early: EarlyNorm | None, norm_type: float
) -> tuple[torch.Tensor, bool]:
    """This rank's part of the window's global gradient norm, and whether its
    ``norm_type``-th power is still to be summed over the data-parallel ranks (the tally's
    collective does that; a rank holding replicas of another rank's shards, HSDP's, adds
    nothing). The inf-norm of a sharded gradient needs a max, not a sum: its own
    collective. A strategy with another layout reduces the norm itself."""
    layout = strategy.gradient_layout
    if layout == "other":
        return strategy.total_norm(grads, norm_type), False
    device = grads[0].device if grads else torch.device("cpu")
    local = early.local(device) if early is not None else shard_norm(grads, norm_type)
    if layout == "replicated":
        return local, False
    if math.isinf(norm_type):
        return strategy.all_reduce_max(local), False  # type: ignore[attr-defined]
    return local * strategy.norm_weight, True
