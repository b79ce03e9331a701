"""DistributedDataParallel: one all-reduce of the gradients, on the last micro-batch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .base import ProcessGroupStrategy, local_norm

__all__ = ["DDPStrategy"]


class DDPStrategy(ProcessGroupStrategy):
    """``no_sync`` must be entered before the forward pass, because DDP decides at forward
    time whether the coming backward reduces; the Stepper wraps forward and backward.
    """

    name = "ddp"

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._check_group_size(model.process_group.size(), "the DDP process group")
        # DDP's forward broadcasts buffers (BatchNorm statistics) from rank 0 when there are
        # any: then the forward communicates, like FSDP2's.
        self.forward_communicates = bool(
            model.broadcast_buffers and any(True for _ in model.module.buffers())
        )

    @staticmethod
    def detects(model: nn.Module) -> bool:
        from torch.nn.parallel import DistributedDataParallel

        return isinstance(model, DistributedDataParallel)

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        if enabled:
            yield
        else:
            with self.model.no_sync():  # type: ignore[operator]
                yield

    def total_norm(self, grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        # After the all-reduce every rank holds the same full gradient: the local norm
        # already is the global one, and reducing it again would count it world_size times.
        return local_norm(grads, norm_type)
