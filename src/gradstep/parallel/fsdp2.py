"""FSDP2 (``fully_shard``): gradients are DTensor shards, reduce-scattered on sync."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .base import ProcessGroupStrategy, post_accumulate_hooks

__all__ = ["FSDP2Strategy", "fsdp_mesh_info"]


class FSDP2Strategy(ProcessGroupStrategy):
    name = "fsdp"
    gradient_layout = "dp_sharded"
    # Every forward all-gathers the parameters of each FSDP module.
    forward_communicates = True

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        self._from_mesh(model, fsdp_mesh_info(model))
        for p in model.parameters():
            if isinstance(p, DTensor):
                self._check_group_size(p.device_mesh.size(), "the FSDP2 device mesh")

    def _from_mesh(self, model: nn.Module, info: Any, dp_group: Any = None) -> None:
        """The state every FSDP2 strategy shares, from FSDP2's mesh record ``info``
        (:func:`fsdp_mesh_info`); ``dp_group``: the data-parallel ranks (None: every rank)."""
        super().__init__(dp_group)
        self.model = model
        self.dp_mesh = getattr(info, "mesh", None)
        # HSDP, a (replicate, shard) mesh: the gradient is sharded within a replica and
        # copied across replicas, so only the first replica's shards count in the norm.
        replica = getattr(info, "replicate_mesh_rank", 0)
        self.norm_weight = 1.0 if replica == 0 else 0.0
        self.replicas = getattr(info, "replicate_mesh_size", 1)

    @staticmethod
    def detects(model: nn.Module) -> bool:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without FSDP2
            return False
        return isinstance(model, FSDPModule)

    @contextlib.contextmanager
    def micro_batch(self, micro_batch: Any, is_last: bool) -> Iterator[Any]:
        # FSDP2 has no no_sync context; the flag is set on every FSDP module (recurse) and
        # must be in place before the forward pass of the micro-batch. It is restored even
        # when the micro-batch raises: a user's own backward afterwards (an error handler,
        # evaluation with grads) must reduce-scatter as usual.
        self.model.set_requires_gradient_sync(is_last)  # type: ignore[operator]
        try:
            yield micro_batch
        finally:
            if not is_last:
                self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def final_grads(self, params: Sequence[nn.Parameter], record: Callable) -> Any:
        """``record(param, local shard)`` once the reduce-scattered shard of a parameter's
        gradient is in place: FSDP2 runs post-accumulate-grad hooks of the sharded
        parameters right after assigning (or accumulating into) their gradient."""
        return post_accumulate_hooks(params, record)

    def hook_targets(
        self, named: Sequence[tuple[str, nn.Parameter]]
    ) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """Where each micro-batch's own gradient appears: FSDP2 computes it on the
        unsharded parameter it all-gathers (one tensor object per parameter, reused by
        every forward), not on the sharded ``nn.Parameter`` the model lists, which only
        ever receives the reduce-scattered shard. Needs the first forward to have run."""
        owner = {id(p): (n, p) for n, p in named}
        out = []
        for fsdp_param in _fsdp_params(self.model):
            found = owner.get(id(fsdp_param.sharded_param))
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if found is not None and unsharded is not None:
                out.append((*found, unsharded))
        return out

    def communicating_modules(self) -> list[nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.model.modules() if isinstance(m, FSDPModule)]

    def discard_partial_grads(self) -> None:
        """Drop the unreduced gradients of micro-batches that ran without sync.

        Under ``set_requires_gradient_sync(False)`` FSDP2 accumulates unsharded gradients
        inside each parameter group, where ``optimizer.zero_grad`` cannot reach; after a
        failed window they would be added into the next synchronised backward. FSDP2 has
        no public call for this (torch 2.13), so the two fields its post-backward reads
        are cleared here, and only here.
        """
        for fsdp_param in _fsdp_params(self.model):
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None


def fsdp_mesh_info(model: nn.Module) -> Any:
    """FSDP2's record of the mesh ``model``'s parameters are sharded on (private API, torch
    2.13: ``FSDPMeshInfo`` with ``mesh``, ``shard_process_group``; ``HSDPMeshInfo`` adds
    ``replicate_mesh_rank``/``_size``). None when no module holds parameters."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                return group.mesh_info
    return None


def _fsdp_params(model: nn.Module) -> Iterator[Any]:
    """FSDP2's per-parameter records (private API, torch 2.13: ``_get_fsdp_state()``,
    ``_fsdp_param_group``; the one place this module reaches into FSDP2's internals)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        group = (
            module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        )
        yield from group.fsdp_params if group is not None else ()


def release_dtensor_caches() -> None:
    """Empty DTensor's global caches, which keep FSDP2's ``DeviceMesh`` alive.

    The mesh holds its process group, so after ``destroy_process_group`` the gloo backend
    (worker threads, the TCP pairs to the other ranks) lived on into interpreter exit and
    was torn down there, after the peers had gone: the rare SIGABRT at exit of FSDP2 runs.
    DDP runs hold no mesh and were never affected. The caches are private (torch 2.13),
    so each is emptied only where it exists; test_failures.py checks that shutdown()
    leaves no backend thread, which fails if a torch upgrade adds another holder.
    """
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return  # DTensor never ran: nothing cached
    try:
        from torch.distributed.tensor import _collective_utils, _redistribute, debug
    except ImportError:  # pragma: no cover - a torch that moved them: the test says so
        return

    clear_sharding = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear_sharding is not None:
        clear_sharding()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()
    for cached in (
        getattr(_redistribute, "_gen_transform_infos", None),
        getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
    ):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
