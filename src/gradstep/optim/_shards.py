"""Whole-tensor sums and norms of (possibly sharded) parameters, in one collective.

LARS and LAMB scale each parameter's update by a ratio of two norms of the *whole*
parameter. Under FSDP2 a parameter is a DTensor and each rank holds one shard of it: the
norm of ``to_local()`` is a shard norm, and a trust ratio built from it differs on every
rank (the published optimizers silently do that under ZeRO and FSDP1). Here every
per-tensor value of a step is stacked into one vector, the sharded entries are summed
over the shard groups with a single ``all_reduce`` (not one per parameter), and the
replicated entries (plain tensors, DDP, the Replicate dim of HSDP) are left alone:
summing those over ranks would count them once per rank. Which groups a tensor is sharded
over is :func:`gradstep.parallel.dtensor.shard_groups`'s answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..parallel import collectives
from ..parallel.dtensor import ShardGroups, wide_dtype

__all__ = ["reduce_over_shards", "whole_norms"]


def reduce_over_shards(values: torch.Tensor, layouts: Sequence[ShardGroups]) -> torch.Tensor:
    """``values[i]`` (a per-tensor local sum) summed over the shards of tensor ``i``.

    One ``all_reduce`` per distinct layout: FSDP2 and HSDP have one, so a step costs one
    collective however many parameters it has.
    """
    by_layout: dict[ShardGroups, list[int]] = {}
    for i, layout in enumerate(layouts):
        if layout:
            by_layout.setdefault(layout, []).append(i)
    if not by_layout:
        return values
    values = values.clone()
    for layout, idx in by_layout.items():
        index = torch.tensor(idx, device=values.device)
        part = values.index_select(0, index)
        for group in layout:
            part = collectives.all_reduce_sum(part, group)
        values.index_copy_(0, index, part)
    return values


def whole_norms(tensors: Sequence[torch.Tensor], layouts: Sequence[ShardGroups]) -> torch.Tensor:
    """The 2-norm of each whole tensor (``tensors`` are local parts, ``layouts`` their
    sharding), as one 1-D tensor; one collective for all of them when any is sharded."""
    if not tensors:
        return torch.zeros(0)
    norms = torch.stack(torch._foreach_norm(list(tensors), 2.0, dtype=wide_dtype(tensors)))
    if not any(layouts):
        # Nothing sharded (one process, DDP): the norms as they are, with no square/sqrt
        # round trip, so one process matches the reference implementations bit for bit.
        return norms
    sharded = torch.tensor([bool(layout) for layout in layouts], device=norms.device)
    squares = reduce_over_shards(norms.square(), layouts)
    return torch.where(sharded, squares.sqrt(), norms)
