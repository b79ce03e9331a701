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

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["EarlyNorm", "combine", "post_accumulate_hooks"]


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
        self.armed = False
        """True once the strategy's hooks were in place for the last backward."""

    def record(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        # At least float32, as torch's own norm of a half-precision gradient is not.
        wide = torch.promote_types(grad.dtype, torch.float32)
        if grad.numel() == 0:  # an empty shard (FSDP2, a parameter smaller than the ranks)
            norm = torch.zeros((), dtype=wide, device=grad.device)  # the inf-norm raises
        else:
            norm = torch.linalg.vector_norm(grad, self.norm_type, dtype=wide)
        self.parts[self.order[id(param)]] = norm

    def local(self, device: torch.device) -> torch.Tensor:
        """The norm over every gradient on this rank: the recorded parts, and the
        gradients of parameters the last backward did not reach."""
        missing = len(self.parts) < len(self.params)  # usually none: no loop
        for i, p in enumerate(self.params if missing else ()):
            if i not in self.parts and p.grad is not None:
                grad = p.grad
                self.record(p, grad.to_local() if hasattr(grad, "to_local") else grad)
        if not self.parts:
            return torch.zeros((), device=device)
        return combine([self.parts[i] for i in sorted(self.parts)], self.norm_type)


@contextlib.contextmanager
def post_accumulate_hooks(
    params: Sequence[nn.Parameter], record: Callable[[Any, torch.Tensor], None], local: Callable
) -> Iterator[None]:
    """``record(param, local(param.grad))`` each time autograd (or FSDP2, for a shard) has
    finished accumulating a parameter's gradient; nothing stays registered afterwards."""
    handles = [
        p.register_post_accumulate_grad_hook(lambda p: record(p, local(p.grad))) for p in params
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
