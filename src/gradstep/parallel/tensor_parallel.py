"""FSDP2 over the data-parallel dims of a mesh, tensor parallel over the ``tp`` dim.

The torchtitan layout: ``parallelize_module(block, mesh["tp"], plan)`` then
``fully_shard(module, mesh=dp_mesh)``, where the data-parallel mesh is ``mesh["dp_shard"]``
(a ``(dp_shard, tp)`` mesh) or ``mesh["dp_replicate", "dp_shard"]`` (HSDP + tensor parallel,
a 3-D ``(dp_replicate, dp_shard, tp)`` mesh); :class:`~gradstep.parallel.layout.Layout`
builds both. Tensor-parallel peers see the same data, so:

- item counts, loss sums and window lengths of *data* are summed over the data-parallel
  ranks only (``dp_group``: FSDP2's shard group, or under HSDP the replicate x shard ranks
  as one group; ``world_size`` = the dp size); decisions every rank must take together
  (window lengths before the first forward, out-of-memory) are agreed over every rank
  (``agree_sum``), or a tp peer with another window would hang in a tp collective;
- FSDP2 averages over the dp dims only (replicate x shard): ``grad_divisor`` is the dp size;
- the global norm counts every shard once and no copy twice: each rank sums ``|g|**p`` of
  its local parts, weighted by :func:`~gradstep.parallel.dtensor.counted` over every rank
  (0 on a copy along a ``Replicate`` dim: an HSDP replica, a ``Replicate`` tp placement; a
  parameter left out of the tp plan lives on the dp mesh alone and is copied across tp),
  then one all-reduce over every rank (a max for the inf-norm). The norm is taken after
  backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .dtensor import counted, shard_norm, to_local
from .fsdp2 import FSDP2Strategy, fsdp_mesh_info

__all__ = ["FSDP2TPStrategy"]


class FSDP2TPStrategy(FSDP2Strategy):
    name = "fsdp_tp"
    gradient_layout = "self_reduced"
    model_parallel = True

    def __init__(self, model: nn.Module) -> None:
        import torch.distributed as dist

        info = fsdp_mesh_info(model)
        _check_meshes(model, info.mesh, dist.get_world_size())
        self._from_mesh(model, info, _dp_group(info))
        self.tp_size = self.agree_ranks // self.world_size

    @staticmethod
    def detects(model: nn.Module) -> bool:
        import torch.distributed as dist

        if not FSDP2Strategy.detects(model) or not dist.is_initialized():
            return False
        info = fsdp_mesh_info(model)
        return info is not None and info.mesh.size() < dist.get_world_size()

    def final_grads(self, params: Sequence[nn.Parameter], record: Callable) -> Any:
        return None  # the norm is taken after backward (see the module docs)

    def total_norm(self, grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        if math.isinf(norm_type):  # copies do not change a max
            return self.agree_max(shard_norm(grads, norm_type))  # over every rank
        locals_ = [to_local(g) for g in grads]
        device = locals_[0].device if locals_ else torch.device("cpu")
        powers = [
            torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) ** norm_type * weight
            for g, whole in zip(locals_, grads, strict=True)
            if g.numel() and (weight := counted(whole, self.agree_ranks))
        ]
        mine = torch.stack(powers).sum() if powers else torch.zeros((), dtype=torch.float64)
        return self.agree_sum(mine.reshape(1).to(device)).reshape(()) ** (1.0 / norm_type)


def _dp_group(info: Any) -> Any:
    """The data-parallel ranks as one process group: FSDP2's shard group, or under HSDP
    its (replicate, shard) mesh flattened (torchtitan's way; a group made once per mesh,
    on every rank together)."""
    if not hasattr(info, "replicate_mesh_rank"):
        return info.shard_process_group
    return info.mesh._flatten().get_group()


def _check_meshes(model: nn.Module, dp_mesh: Any, world: int) -> Any:
    """Every parameter lies on the dp mesh, or on a mesh that starts with the dp dims and
    spans every rank (dp x tp); returns such a full mesh."""
    from torch.distributed.tensor import DTensor

    from ..errors import UnsupportedSetup

    dp_names = tuple(dp_mesh.mesh_dim_names or ())
    full = None
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        if mesh == dp_mesh:
            continue
        names = tuple(mesh.mesh_dim_names or ())
        if names[: len(dp_names)] != dp_names or mesh.size() != world:
            raise UnsupportedSetup(
                f"parameter {name} lies on mesh {names} of {mesh.size()} ranks; with FSDP2 "
                f"over {dp_names} every parameter must lie on that mesh or on one that "
                f"starts with it and spans all {world} ranks (FSDP2 + tensor parallel); "
                "pipeline parallelism is not supported (docs/library/distributed.md)"
            )
        full = mesh
    if full is None:
        raise UnsupportedSetup(
            f"the FSDP2 device mesh spans {dp_mesh.size()} of {world} ranks and no parameter "
            "is tensor parallel over the rest: gradstep supports data parallelism over the "
            "whole default process group, HSDP, and FSDP2 + tensor parallel (a (dp, tp) or "
            "(dp_replicate, dp_shard, tp) mesh); pipeline parallelism is not supported "
            "(docs/library/distributed.md)"
        )
    return full
