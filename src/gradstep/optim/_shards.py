"""Whole-tensor sums and norms of (possibly sharded) parameters, in one collective.

LARS and LAMB scale each parameter's update by a ratio of two norms of the *whole*
parameter. Under FSDP2 a parameter is a DTensor and each rank holds one shard of it: the
norm of ``to_local()`` is a shard norm, and a trust ratio built from it differs on every
rank (the published optimizers silently do that under ZeRO and FSDP1). Here every
per-tensor value of a step is stacked into one vector, the sharded entries are summed
over the shard groups with a single ``all_reduce`` (not one per parameter), and the
replicated entries (plain tensors, DDP, the Replicate dim of HSDP) are left alone:
summing those over ranks would count them once per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import UnsupportedSetup
from ..parallel import collectives

__all__ = ["local", "reduce_over_shards", "shard_groups", "whole_norms"]

Layout = tuple[Any, ...]
"""The process groups a tensor is sharded over (empty: every rank holds all of it)."""


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (a view: in-place edits reach the
    DTensor), a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def shard_groups(t: torch.Tensor) -> Layout:
    """The process groups over which a sum over the whole of ``t`` must be reduced.

    Any ``Shard(d)`` mesh dimension splits the elements, whatever ``d``: a whole-tensor
    sum is the sum of the shards' sums. ``Replicate`` needs nothing; ``Partial`` would
    mean the parameter itself is unreduced, which no optimizer can step correctly.
    """
    if not hasattr(t, "device_mesh"):
        return ()
    groups = []
    for dim, placement in enumerate(t.placements):
        if placement.is_shard():
            groups.append(t.device_mesh.get_group(dim))
        elif placement.is_partial():
            raise UnsupportedSetup(
                f"gradstep.optim: a parameter with a Partial placement ({t.placements}) has "
                "no whole value to take a norm of; shard or replicate it"
            )
    return tuple(groups)


def reduce_over_shards(values: torch.Tensor, layouts: Sequence[Layout]) -> torch.Tensor:
    """``values[i]`` (a per-tensor local sum) summed over the shards of tensor ``i``.

    One ``all_reduce`` per distinct layout: FSDP2 and HSDP have one, so a step costs one
    collective however many parameters it has.
    """
    by_layout: dict[Layout, list[int]] = {}
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


def norm_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """At least float32: a bf16 sum of squares over a large matrix loses most digits."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def whole_norms(tensors: Sequence[torch.Tensor], layouts: Sequence[Layout]) -> torch.Tensor:
    """The 2-norm of each whole tensor (``tensors`` are local parts, ``layouts`` their
    sharding), as one 1-D tensor; one collective for all of them when any is sharded."""
    if not tensors:
        return torch.zeros(0)
    norms = torch.stack(torch._foreach_norm(list(tensors), 2.0, dtype=norm_dtype(tensors)))
    if not any(layouts):
        # Nothing sharded (one process, DDP): the norms as they are, with no square/sqrt
        # round trip, so one process matches the reference implementations bit for bit.
        return norms
    sharded = torch.tensor([bool(layout) for layout in layouts], device=norms.device)
    squares = reduce_over_shards(norms.square(), layouts)
    return torch.where(sharded, squares.sqrt(), norms)
