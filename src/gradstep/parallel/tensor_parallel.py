"""FSDP2 over the data-parallel dim of a 2-D mesh, tensor parallel over the other.

The torchtitan layout: ``parallelize_module(block, mesh["tp"], plan)`` then
``fully_shard(module, mesh=mesh["dp"])``. Tensor-parallel peers see the same data, so:

- item counts, loss sums and window lengths of *data* are summed over the data-parallel
  group only (``dp_group``, ``world_size`` = the dp size); decisions every rank must take
  together (window lengths before the first forward, out-of-memory) are agreed over every
  rank (``agree_sum``), or a tp peer with another window would hang in a tp collective;
- FSDP2 averages over the dp dim only: ``grad_divisor`` is the dp size;
- the global norm counts every shard once and no copy twice: each rank sums ``|g|**p``
  over its local parts that are the first copy along every replicated dim (a
  ``Replicate`` tp placement, or a parameter left out of the tp plan, which lives on the
  dp mesh alone and is copied across tp), then one all-reduce over every rank (a max for
  the inf-norm). The norm is taken after backward.

HSDP with tensor parallelism (a 3-D mesh) is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .base import ProcessGroupStrategy
from .dtensor import first_copy, shard_norm, to_local
from .fsdp2 import FSDP2Strategy, fsdp_mesh_info

__all__ = ["FSDP2TPStrategy"]


class FSDP2TPStrategy(FSDP2Strategy):
    name = "fsdp_tp"
    gradient_layout = "self_reduced"
    model_parallel = True

    def __init__(self, model: nn.Module) -> None:

        from ..errors import UnsupportedSetup

        info = fsdp_mesh_info(model)
        if hasattr(info, "replicate_mesh_rank"):
            raise UnsupportedSetup(
                "HSDP with tensor parallelism (a (replicate, shard, tp) mesh) is not "
                "supported: use HSDP, or FSDP2 over the dp dim of a (dp, tp) mesh"
            )
        ProcessGroupStrategy.__init__(self, info.shard_process_group)
        self.model = model
        self.norm_weight = 1.0
        self.replicas = 1
        self.dp_mesh = info.mesh
        self.tp_size = self.agree_ranks // self.world_size
        full = _check_meshes(model, self.dp_mesh, self.agree_ranks)
        dp_names = set(self.dp_mesh.mesh_dim_names or ())
        # Parameters on the dp mesh alone are copies across the other dims: they count on
        # this rank only where its coordinates on those dims are all 0.
        self._first_on_model_dims = all(
            full.get_local_rank(name) == 0 for name in full.mesh_dim_names if name not in dp_names
        )

    @staticmethod
    def detects(model: nn.Module) -> bool:
        import torch.distributed as dist

        if not FSDP2Strategy.detects(model) or not dist.is_initialized():
            return False
        info = fsdp_mesh_info(model)
        return info is not None and info.mesh.size() < dist.get_world_size()

    def final_grads(self, params: Sequence[nn.Parameter], record: Callable) -> Any:
        return None  # the norm is taken after backward (see the module docs)

    def counted(self, t: torch.Tensor) -> bool:
        """Whether this rank's part of ``t`` counts in a sum over every rank."""
        mesh = getattr(t, "device_mesh", None)
        if mesh is not None and mesh.size() == self.agree_ranks:
            return first_copy(t)
        return first_copy(t) and self._first_on_model_dims

    def total_norm(self, grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        import torch.distributed as dist

        if math.isinf(norm_type):  # copies do not change a max
            out = shard_norm(grads, norm_type).to(torch.float64, copy=True)
            dist.all_reduce(out, op=dist.ReduceOp.MAX)  # over every rank, not dp alone
            return out
        locals_ = [to_local(g) for g in grads]
        device = locals_[0].device if locals_ else torch.device("cpu")
        powers = [
            torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) ** norm_type
            for g, whole in zip(locals_, grads, strict=True)
            if g.numel() and self.counted(whole)
        ]
        mine = torch.stack(powers).sum() if powers else torch.zeros((), dtype=torch.float64)
        return self.agree_sum(mine.reshape(1).to(device)).reshape(()) ** (1.0 / norm_type)


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
                "pipeline parallelism is not supported (docs/distributed.md)"
            )
        full = mesh
    if full is None:
        raise UnsupportedSetup(
            f"the FSDP2 device mesh spans {dp_mesh.size()} of {world} ranks and no parameter "
            "is tensor parallel over the rest: gradstep supports data parallelism over the "
            "whole default process group, HSDP, and FSDP2 + tensor parallel (a (dp, tp) mesh); "
            "pipeline parallelism is not supported (docs/distributed.md)"
        )
    return full
