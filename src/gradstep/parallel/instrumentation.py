"""Test and benchmark instrumentation: count the gradient collectives DDP and FSDP2 issue.

NOT part of the training path. It reaches into FSDP2's private comm interface
(``torch.distributed.fsdp._fully_shard._fsdp_api``), which the public
``set_custom_reduce_scatter`` takes but torch does not re-export: a torch upgrade that
moves it breaks this file only, and only the tests and ``bench/distributed.py`` use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = ["CommCounter", "count_gradient_comms"]


@dataclass
class CommCounter:
    """Gradient collectives issued by DDP (all-reduces) or FSDP2 (reduce-scatters).

    ``bytes`` is the size of each collective's input buffer (the full bucket for DDP, the
    full unsharded gradient of a parameter group for FSDP2), summed; what a ring algorithm
    sends per rank is about ``(world - 1) / world`` of it.
    """

    calls: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0

    def add(self, t: torch.Tensor) -> None:
        self.calls += 1
        self.bytes += t.numel() * t.element_size()


# Unannotated on purpose: DDP checks the hook's annotations against the real classes, and
# with postponed evaluation (``from __future__ import annotations``) they are strings.
def _ddp_counting_hook(counter, bucket):  # type: ignore[no-untyped-def]
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter.add(bucket.buffer())
    return allreduce_hook(None, bucket)  # DDP's own behaviour: average over the world


def _counting_reduce_scatter(counter: CommCounter) -> ReduceScatter:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class CountingReduceScatter(ReduceScatter):
        """FSDP2's default reduce-scatter, counted."""

        def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
            counter.add(input_tensor)
            return dist.reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )

    return CountingReduceScatter()


def count_gradient_comms(model: nn.Module) -> CommCounter:
    """Count the gradient collectives of a DDP or FSDP2 model from now on.

    DDP: a communication hook equal to DDP's default all-reduce (register before the first
    backward; DDP allows one hook). FSDP2: a reduce-scatter equal to the default, set on
    every FSDP module. Used by the tests and bench/distributed.py to show that gradients
    are reduced once per optimizer step, not once per micro-batch.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    counter = CommCounter()
    if isinstance(model, DistributedDataParallel):
        model.register_comm_hook(counter, _ddp_counting_hook)
    elif isinstance(model, FSDPModule):
        comm = _counting_reduce_scatter(counter)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(comm)
    else:
        raise TypeError(
            f"count_gradient_comms needs a DDP or FSDP2 model, got {type(model).__name__}"
        )
    return counter
