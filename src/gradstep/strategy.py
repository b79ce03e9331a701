"""How gradients are synchronised and reduced, one small class per parallel strategy.

The Stepper asks a strategy four things and nothing else: a context that turns gradient
sync on or off for one micro-batch, the factor by which the backend already divided the
gradients (DDP and FSDP2 average over ranks), a sum over ranks of a few scalars, and the
global norm of the (possibly sharded) gradients. Everything that is DDP- or FSDP-specific
lives here, not in the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import nn


class Strategy(Protocol):
    world_size: int

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-batch's forward AND backward; sync only when ``enabled``."""

    @property
    def grad_divisor(self) -> float:
        """What the backend divided the summed gradients by (1 when it sums)."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over ranks (identity on one process)."""

    def total_norm(self, grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Norm of all gradients on all ranks/shards, identical on every rank."""

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on at least one."""


def _local_norm(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(list(grads), norm_type=norm_type, foreach=None)


class LocalStrategy:
    """A single process: nothing to synchronise."""

    world_size = 1
    grad_divisor = 1.0

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def total_norm(self, grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        return _local_norm(grads, norm_type)

    def any_rank(self, flag: bool) -> bool:
        return flag


class _ProcessGroupStrategy:
    """Shared collectives for strategies that run on a process group."""

    def __init__(self, model: nn.Module) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "a DDP/FSDP model was given but torch.distributed is not initialised; "
                "call gradstep.distributed.init() (or dist.init_process_group) first"
            )
        self.model = model
        self.world_size = dist.get_world_size()
        # Collectives must run on the backend's device (CUDA for NCCL, CPU for gloo).
        backend = dist.get_backend()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )

    @property
    def grad_divisor(self) -> float:
        return float(self.world_size)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = t.to(self.device)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(t.device)

    def any_rank(self, flag: bool) -> bool:
        return bool(self.all_reduce_sum(torch.tensor([float(flag)], dtype=torch.float64)) > 0)


class DDPStrategy(_ProcessGroupStrategy):
    """DistributedDataParallel: one all-reduce of the gradients on the last micro-batch.

    ``no_sync`` must be entered before the forward pass, because DDP decides at forward
    time whether the coming backward reduces; the Stepper wraps forward and backward.
    """

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
        return _local_norm(grads, norm_type)


class FSDP2Strategy(_ProcessGroupStrategy):
    """FSDP2 (``fully_shard``): gradients are DTensor shards, reduce-scattered on sync."""

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        # FSDP2 has no no_sync context; the flag is set on every FSDP module (recurse) and
        # must be in place before the forward pass of the micro-batch.
        self.model.set_requires_gradient_sync(enabled)  # type: ignore[operator]
        yield

    def total_norm(self, grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        # Norms of DTensor shards come back as a DTensor with a Partial placement;
        # full_tensor() performs the cross-shard reduction (sum of p-th powers, or max).
        from torch.distributed.tensor import DTensor

        norm = _local_norm(grads, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return norm


def strategy_for(model: nn.Module) -> Strategy:
    """Pick the strategy from the model's wrapper type; users change nothing else."""
    if torch.distributed.is_available():
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            return DDPStrategy(model)
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without FSDP2
            FSDPModule = ()  # type: ignore[assignment,misc]
        if isinstance(model, FSDPModule):
            return FSDP2Strategy(model)
    return LocalStrategy(model)
