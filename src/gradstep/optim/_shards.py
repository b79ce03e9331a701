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

__all__ = ["reduce_over_shards", "sum_parts", "whole_norms"]


def sum_parts(parts: Sequence[torch.Tensor], layouts: Sequence[ShardGroups]) -> list[torch.Tensor]:
    """Each of ``parts`` (local sums of any shape: per tensor, per row) summed over the
    groups of its layout; replicated ones (an empty layout) as they are.

    The parts of one layout travel together: one ``all_reduce`` per group of each distinct
    layout, in the order the layouts first appear (the same on every rank: the ranks list
    the same parameters). FSDP2 and HSDP have one layout; a (dp, tp) mesh a few.
    """
    out = list(parts)
    by_layout: dict[ShardGroups, list[int]] = {}
    for i, layout in enumerate(layouts):
        if layout:
            by_layout.setdefault(layout, []).append(i)
    for layout, idx in by_layout.items():
        part = torch.cat([parts[i].reshape(-1) for i in idx])
        for group in layout:
            part = collectives.all_reduce_sum(part, group)
        pieces = part.split([parts[i].numel() for i in idx])
        for i, piece in zip(idx, pieces, strict=True):
            out[i] = piece.view_as(parts[i])
    return out


def reduce_over_shards(values: torch.Tensor, layouts: Sequence[ShardGroups]) -> torch.Tensor:
    """``values[i]`` (a per-tensor local sum) summed over the shards of tensor ``i``: one
    ``all_reduce`` per distinct layout (FSDP2 and HSDP have one, so a step costs one
    collective however many parameters it has)."""
    if not any(layouts):
        return values
    return torch.stack(sum_parts(list(values.unbind(0)), layouts))


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
