"""How gradients are synchronised and reduced, one small class per parallel strategy.

The Stepper asks a strategy a few things and nothing else: a context that turns gradient
sync on or off for one micro-batch, the factor by which the backend already divided the
gradients (DDP and FSDP2 average over ranks), a sum over ranks of a few scalars, the
global norm of the (possibly sharded) gradients, and whether the forward pass itself runs
collectives (then every rank's window length is compared before the first forward).
Everything that is DDP- or FSDP-specific lives here, not in the step.

Only pure data parallelism over the whole default process group is supported: the Stepper
sums item counts over every rank, so a rank that holds no distinct data (tensor or pipeline
parallel peers) would be counted twice. The strategies check the group size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import nn


class Strategy(Protocol):
    world_size: int
    forward_communicates: bool
    """True when the forward pass runs collectives (FSDP2 all-gathers parameters): ranks
    with different window lengths would then pair unrelated collectives and hang, so the
    lengths must be compared with :meth:`check_window` before the first forward."""

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

    def check_window(self, n: int) -> None:
        """Raise on every rank unless every rank passes ``n`` micro-batches (one collective)."""


def window_length_error(n: int, n_sum: float, n2_sum: float, world: int) -> RuntimeError | None:
    """The error for ranks whose windows differ, from sums over ranks of n and n^2.

    All n equal <=> world * sum(n^2) == sum(n)^2 (Cauchy-Schwarz), so one sum-reduction of
    two numbers tells every rank the same thing.
    """
    if n2_sum * world == n_sum * n_sum:
        return None
    return RuntimeError(
        f"ranks ran windows of different lengths (this rank: {n} micro-batches, mean over "
        f"{world} ranks: {n_sum / world:g}); every rank must pass the same number of "
        "micro-batches to Stepper.step"
    )


def _local_norm(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(list(grads), norm_type=norm_type, foreach=None)


class LocalStrategy:
    """A single process: nothing to synchronise."""

    world_size = 1
    grad_divisor = 1.0
    forward_communicates = False

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

    def check_window(self, n: int) -> None:
        return None


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

    def check_window(self, n: int) -> None:
        local = torch.tensor([float(n), float(n * n)], dtype=torch.float64)
        n_sum, n2_sum = self.all_reduce_sum(local).tolist()
        error = window_length_error(n, n_sum, n2_sum, self.world_size)
        if error is not None:
            raise error

    def _check_group_size(self, size: int, what: str) -> None:
        if size != self.world_size:
            raise NotImplementedError(
                f"{what} spans {size} of {self.world_size} ranks; gradstep supports data "
                "parallelism over the whole default process group only (item counts are "
                "summed over every rank)"
            )


class DDPStrategy(_ProcessGroupStrategy):
    """DistributedDataParallel: one all-reduce of the gradients on the last micro-batch.

    ``no_sync`` must be entered before the forward pass, because DDP decides at forward
    time whether the coming backward reduces; the Stepper wraps forward and backward.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._check_group_size(model.process_group.size(), "the DDP process group")
        # DDP's forward broadcasts buffers (BatchNorm statistics) from rank 0 when there are
        # any: then the forward communicates, like FSDP2's.
        self.forward_communicates = bool(
            model.broadcast_buffers and any(True for _ in model.module.buffers())
        )

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

    # Every forward all-gathers the parameters of each FSDP module.
    forward_communicates = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        from torch.distributed.tensor import DTensor

        for p in model.parameters():
            if isinstance(p, DTensor):
                self._check_group_size(p.device_mesh.size(), "the FSDP2 device mesh")

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
