"""DTensor facts in one place: a shard's local view, its shard groups, norms of local parts.

FSDP2 (and tensor parallelism) hand out parameters and gradients as DTensors. Everything in
gradstep that measures them locally asks here, so "what is this rank's part", "which process
groups does a whole-tensor sum cross" and "in which dtype is a norm taken" each have one
answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..errors import UnsupportedSetup

__all__ = [
    "ShardGroups",
    "first_copy",
    "norm32",
    "shard_groups",
    "to_local",
    "wide_dtype",
]

ShardGroups = tuple[Any, ...]
"""The process groups a tensor's elements are split over (empty: every rank holds all)."""


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view: in-place edits reach the DTensor), the tensor
    itself when it is a plain one."""
    local = getattr(t, "to_local", None)
    return local() if local is not None else t


def _splits_elements(placement: Any) -> bool:
    """Whether ``placement`` gives each rank of its mesh dim a different part of the tensor.

    ``_StridedShard`` (FSDP2 on top of tensor parallelism: the dp dim of a (dp, tp) mesh
    sharding a dim tp already shards) is a shard too, though its ``is_shard()`` is False in
    torch 2.13.
    """
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def shard_groups(t: torch.Tensor) -> ShardGroups:
    """The process groups a sum over the whole of ``t`` must be reduced over, in mesh order.

    One group per mesh dimension whose placement splits the elements (``Shard(d)`` for any
    ``d``, ``_StridedShard``): the whole tensor's sum is the sum of its parts' sums over
    every such dim, so on a (dp, tp) mesh a weight sharded on both dims needs both groups,
    and one sharded on dp and replicated on tp needs dp alone (summing over a ``Replicate``
    dim would count each part once per rank). A plain tensor needs none. ``Partial`` means
    the tensor itself is an unreduced sum, with no whole value to measure: refused, as is a
    placement this rule does not know.
    """
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return ()
    placements = tuple(t.placements)  # type: ignore[attr-defined]
    groups = []
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if not _splits_elements(placement):
            raise UnsupportedSetup(
                f"a DTensor with placements {placements} (neither Shard nor Replicate on mesh "
                f"dim {dim}) has no whole value whose sum or norm gradstep can take (Partial "
                "is an unreduced sum); redistribute it to Shard or Replicate first"
            )
        groups.append(mesh.get_group(dim))
    return tuple(groups)


def first_copy(t: torch.Tensor) -> bool:
    """Whether this rank's part of ``t`` is the one that counts in a sum over every rank of
    its mesh: along each ``Replicate`` dim only coordinate 0 counts (the others hold copies
    of the same part). True for a plain tensor."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return True
    placements = tuple(t.placements)  # type: ignore[attr-defined]
    return all(
        mesh.get_local_rank(dim) == 0 for dim, pl in enumerate(placements) if pl.is_replicate()
    )


def wide_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype norms and sums of ``tensors`` are taken in: at least float32 (a bf16 sum of
    squares over a large matrix loses most of its digits), float64 if any is float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def norm32(t: torch.Tensor, norm_type: float = 2.0, dim: int | None = None) -> torch.Tensor:
    """``vector_norm`` in at least float32 (torch's own norm of a bf16/fp16 tensor rounds in
    that dtype); an empty tensor's norm is 0 (the inf-norm of an empty shard raises)."""
    wide = wide_dtype((t,))
    if t.numel() == 0 and dim is None:
        return torch.zeros((), dtype=wide, device=t.device)
    return torch.linalg.vector_norm(t, norm_type, dim=dim, dtype=wide)
