"""The strategy protocol: what the step asks of a parallel layout, and nothing more.

A strategy answers five questions for :class:`gradstep.Stepper`: a context that turns
gradient sync on or off for one micro-batch, the factor by which the backend already
divided the gradients (DDP and FSDP2 average over ranks), a sum over the data-parallel
ranks of a few scalars, how the gradient is laid out over the ranks (which says how its
global norm is assembled, see ``gradient_layout``), and whether the forward pass itself
runs collectives (then every rank's window length is compared before the first forward).
Everything DDP- or FSDP-specific lives in its own file.

Optional capabilities are declared by implementing a small protocol, checked once with
``isinstance``: :class:`FinalGrads` (where gradients become final in the last backward,
for the norm taken there).

Item counts are summed over the strategy's data-parallel group (``dp_group``; None is the
whole default group): ranks that hold no distinct data (tensor or pipeline peers) must not
be counted twice. A tensor-parallel strategy is a new file here that sets ``dp_group`` and
reduces the norm over its model-parallel dimensions too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .._handles import removing
from .dtensor import to_local

__all__ = [
    "GRADIENT_LAYOUTS",
    "FinalGrads",
    "Strategy",
    "local_norm",
    "post_accumulate_hooks",
    "shard_norm",
    "window_length_error",
]

GRADIENT_LAYOUTS = ("replicated", "dp_sharded", "other")
"""How the reduced gradient lies on the ranks. ``replicated``: every rank holds all of it
(one process, DDP): the local norm is the global one. ``dp_sharded``: each rank holds a
disjoint shard over the data-parallel group (FSDP2): the p-th powers of the local norms sum
over that group, in the step's one collective. ``other``: the strategy's ``total_norm``
reduces it (its own collectives)."""


@runtime_checkable
class Strategy(Protocol):
    name: str
    """Short name, as in ``prepare_model(model, strategy=...)`` ("none", "ddp", "fsdp")."""
    world_size: int
    """Ranks in the data-parallel group (1 on a single process)."""
    dp_group: Any
    """The data-parallel process group (None: the default group, or no group at all)."""
    distributed: bool
    """True when gradients are reduced by a backend (DDP, FSDP2)."""
    gradient_layout: str
    """One of :data:`GRADIENT_LAYOUTS`."""
    norm_weight: float
    """1, or 0 on a rank whose gradient shards are replicas of another rank's (HSDP's
    replicate dimension): what this rank's ``norm**p`` counts for in a ``dp_sharded`` sum."""
    agree_ranks: int
    """Ranks that must take every branch together (all ranks of the job: data-parallel
    peers and model-parallel peers alike); :meth:`agree_sum` sums over them."""
    forward_communicates: bool
    """True when the forward pass runs collectives (FSDP2 all-gathers parameters): ranks
    with different window lengths would then pair unrelated collectives and hang, so the
    lengths must be compared with :meth:`check_window` before the first forward."""

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-batch's forward AND backward; sync only when ``enabled``."""
        ...

    @property
    def grad_divisor(self) -> float:
        """What the backend divided the summed gradients by (1 when it sums)."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over the data-parallel ranks (identity on one process)."""
        ...

    def agree_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over :attr:`agree_ranks`: for decisions every rank must take
        together (window lengths, out-of-memory), not for data."""
        ...

    def total_norm(self, grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Norm of all gradients on all ranks/shards, identical on every rank."""
        ...

    def check_window(self, n: int) -> None:
        """Raise on every rank unless every rank passes ``n`` micro-batches (one collective)."""
        ...

    def discard_partial_grads(self) -> None:
        """Forget gradients a failed window accumulated outside ``param.grad``."""
        ...

    def hook_targets(
        self, named: Sequence[tuple[str, nn.Parameter]]
    ) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, tensor whose autograd gradient is that parameter's micro-batch
        gradient): the parameter itself, except where the backend computes on a copy."""
        ...

    def communicating_modules(self) -> list[nn.Module]:
        """Modules whose forward starts with a collective (FSDP2 units all-gather, DDP with
        buffers broadcasts), in no particular order; empty when forwards do not talk."""
        ...


@runtime_checkable
class FinalGrads(Protocol):
    """A strategy that knows where each gradient becomes final in the last backward."""

    def final_grads(
        self, params: Sequence[nn.Parameter], record: Callable[[nn.Parameter, torch.Tensor], None]
    ) -> contextlib.AbstractContextManager[None] | None:
        """A context for the last micro-batch's backward that calls ``record(param, this
        rank's part of its final gradient)``; None when it cannot on this model."""
        ...


def post_accumulate_hooks(
    params: Sequence[nn.Parameter], record: Callable[[Any, torch.Tensor], None]
) -> contextlib.AbstractContextManager[None]:
    """``record(param, local part of param.grad)`` each time autograd (or FSDP2, for a
    shard) has finished accumulating a parameter's gradient; nothing stays registered
    after the ``with`` block."""
    return removing(
        p.register_post_accumulate_grad_hook(lambda p: record(p, to_local(p.grad))) for p in params
    )


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


def local_norm(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Norm of this process's gradient tensors (a DTensor with Partial placement for shards)."""
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(list(grads), norm_type=norm_type, foreach=None)


def shard_norm(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Norm of this rank's parts of the gradients (a DTensor's local shard); empty shards
    (a parameter with fewer rows than ranks) count as zero, also for the inf-norm."""
    local = [to_local(g) for g in grads]
    if math.isinf(norm_type):
        local = [g for g in local if g.numel()]
    if not local:
        return torch.zeros((), device=grads[0].device if grads else None)
    return local_norm(local, norm_type)


class ProcessGroupStrategy:
    """What every strategy on a process group shares: the group, its size, the collectives.

    ``dp_group`` None means the default group: pure data parallelism over every rank.
    """

    name = "group"
    distributed = True
    gradient_layout = "replicated"
    norm_weight = 1.0
    model_parallel = False
    """True in a subclass whose ``dp_group`` is smaller than the world on purpose (the other
    ranks hold other parts of the model, not other data)."""

    def __init__(self, dp_group: Any = None) -> None:
        from ..errors import UnsupportedSetup
        from . import collectives

        if not collectives.is_initialized():
            raise RuntimeError(
                "a DDP/FSDP model was given but torch.distributed is not initialised; "
                "call gradstep.parallel.init() (or dist.init_process_group) first"
            )
        import torch.distributed as dist

        self.dp_group = dp_group
        self.world_size = dist.get_world_size(dp_group)
        self.agree_ranks = dist.get_world_size()
        if self.world_size != self.agree_ranks and not self.model_parallel:
            raise UnsupportedSetup(
                f"dp_group spans {self.world_size} of {dist.get_world_size()} ranks; the "
                "built-in strategies are data parallel over the whole default group, except "
                "FSDP2TPStrategy (a model-parallel strategy sets model_parallel = True and "
                "reduces its norm over the other ranks itself)"
            )

    @property
    def grad_divisor(self) -> float:
        return float(self.world_size)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        from .collectives import all_reduce_sum

        return all_reduce_sum(t, self.dp_group)

    def agree_sum(self, t: torch.Tensor) -> torch.Tensor:
        from .collectives import all_reduce_sum

        return all_reduce_sum(t, None)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """The maximum of a small tensor over the data-parallel ranks (a float64 copy)."""
        import torch.distributed as dist

        out = t.to(torch.float64, copy=True)  # the all-reduce is in place
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.dp_group)
        return out

    def check_window(self, n: int) -> None:
        local = torch.tensor([float(n), float(n * n)], dtype=torch.float64)
        n_sum, n2_sum = self.agree_sum(local).tolist()
        error = window_length_error(n, n_sum, n2_sum, self.agree_ranks)
        if error is not None:
            raise error

    def discard_partial_grads(self) -> None:
        return None  # DDP's no_sync accumulates in param.grad, which zero_grad clears

    def hook_targets(
        self, named: Sequence[tuple[str, nn.Parameter]]
    ) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        return [(n, p, p) for n, p in named]

    def communicating_modules(self) -> list[nn.Module]:
        model = getattr(self, "model", None)
        return [model] if self.forward_communicates and model is not None else []

    def _check_group_size(self, size: int, what: str) -> None:
        from ..errors import UnsupportedSetup

        if size != self.world_size:
            raise UnsupportedSetup(
                f"{what} spans {size} of {self.world_size} ranks; gradstep supports data "
                "parallelism over the whole default process group (DDP, FSDP2, HSDP) and "
                "FSDP2 + tensor parallel over a (dp, tp) mesh; pipeline parallelism is not "
                "supported (docs/distributed.md)"
            )
