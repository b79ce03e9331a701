"""DTensor facts in one place: a shard's local view, which copy counts, the groups a
whole-tensor sum crosses, norms and sums of local parts.

FSDP2 (and tensor parallelism) hand out parameters and gradients as DTensors. Everything in
gradstep that measures them asks here (the step's global norm, tensor parallel, AGC, the
noise scale, LARS and LAMB), so "what is this rank's part" (:func:`to_local`), "what does
this rank's part count for in a sum over every rank" (:func:`counted`, on
:func:`first_copy`), "which process groups does a whole-tensor sum cross"
(:func:`shard_groups`) and "in which dtype is a norm taken" (:func:`wide_dtype`) each have
one answer. The whole-tensor sums and norms (:func:`sum_parts`,
:func:`reduce_over_shards`, :func:`whole_norms`) put every per-tensor value of a step into
one vector and reduce the sharded entries with one ``all_reduce`` per distinct sharding, not
one per parameter; replicated entries (plain tensors, DDP, HSDP's replicate dim) are left
alone: summing those over ranks would count them once per rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import UnsupportedSetup
from . import collectives

__all__ = [
    "ShardGroups",
    "counted",
    "first_copy",
    "local_norm",
    "norm32",
    "reduce_over_shards",
    "shard_groups",
    "shard_norm",
    "sum_parts",
    "to_local",
    "whole_norms",
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


def counted(t: torch.Tensor, ranks: int) -> float:
    """What this rank's local part of ``t`` counts for in a sum over ``ranks`` ranks that
    hold ``t`` between them, for that sum to count every element of ``t`` once: the one
    counted-once rule (the tensor-parallel norm and the noise scale use it).

    ``t``'s mesh (a plain tensor: this rank alone) splits it along its ``Shard`` dims and
    copies it along its ``Replicate`` dims, where only coordinate 0 counts
    (:func:`first_copy`). When the mesh spans fewer than ``ranks`` ranks, the others are
    ``ranks / mesh size - 1`` more groups holding ``t`` the same way (the tensor-parallel
    peers of a parameter on the data-parallel mesh alone, of a plain tensor): every group
    counts for its share. So: ``mesh size / ranks`` on a first copy, 0 on another copy
    (exact sums when the ratio is a power of two). ``ranks`` must be a multiple of the
    mesh's size.
    """
    mesh = getattr(t, "device_mesh", None)
    size = 1 if mesh is None else int(mesh.size())
    if ranks < size or ranks % size:
        raise UnsupportedSetup(
            f"a tensor on a mesh of {size} ranks cannot be counted over {ranks} ranks (not "
            "a multiple of its mesh's size): its copies are not whole groups of ranks"
        )
    return size / ranks if first_copy(t) else 0.0


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


def local_norm(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Norm of this process's tensors, as they are (a DTensor's comes back Partial)."""
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(list(grads), norm_type=norm_type, foreach=None)


def shard_norm(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Norm of this rank's parts of the tensors (a DTensor's local shard); empty shards (a
    parameter with fewer rows than ranks) count as zero, also for the inf-norm."""
    local = [to_local(g) for g in grads]
    if math.isinf(norm_type):
        local = [g for g in local if g.numel()]
    if not local:
        return torch.zeros((), device=grads[0].device if grads else None)
    return local_norm(local, norm_type)


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
