"""The few collectives gradstep needs, and the facts about the process group they run on.

Every other module asks here instead of calling ``torch.distributed`` itself, so "is a
group up", "which device does a collective run on" and "unwrap the model" each have one
answer. All of them are safe to call without a process group (then they describe a world
of one process and reduce nothing).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "agree",
    "all_reduce_max",
    "all_reduce_sum",
    "barrier",
    "broadcast_from_rank0",
    "comm_device",
    "is_initialized",
    "is_main",
    "min_over_ranks",
    "rank",
    "unwrap",
    "world_size",
]


def is_initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    """True on the one process that prints, logs and writes files."""
    return rank() == 0


def comm_device() -> torch.device:
    """The device the backend's collectives take their tensors on (CUDA for NCCL)."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``t`` summed over the ranks of ``group`` (a copy on ``t``'s device; ``t`` itself
    without a process group)."""
    if not is_initialized():
        return t
    out = t.to(comm_device())
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.to(t.device)


def all_reduce_max(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The maximum of ``t`` over the ranks of ``group``, as a float64 copy (the copy itself
    without a process group)."""
    out = t.to(torch.float64, copy=True)  # the all-reduce is in place
    if is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def agree(flag: bool, group: Any = None) -> bool:
    """True on every rank when ``flag`` is true on any rank of ``group`` (one collective and
    one host read; ``flag`` itself without a process group)."""
    if not is_initialized() or dist.get_world_size(group) == 1:
        return bool(flag)
    return bool(all_reduce_sum(torch.tensor([float(flag)], dtype=torch.float64), group).item() > 0)


def min_over_ranks(n: int) -> int:
    """The smallest ``n`` over all ranks (``n`` itself without a process group).

    For loops whose forward passes must line up across ranks (FSDP2 all-gathers in every
    forward): each rank runs only as many iterations as the rank with the fewest.
    """
    if world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if is_initialized():
        dist.barrier()


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's picklable ``value`` on every rank (identity on one process)."""
    if not is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module: no DDP wrapper, no ``torch.compile`` wrapper (looped, any order).

    FSDP2 shards the module in place, so there is nothing to unwrap for it. The names of
    the result's parameters are the checkpoint keys and the names users write.
    """
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # torch.compile's OptimizedModule
        else:
            return model
