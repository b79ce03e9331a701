"""The layouts ``prepare_model(model, "fsdp", ...)`` builds: FSDP2 over every rank, HSDP
(``hsdp=R``) and FSDP2 + tensor parallel (``tp=N``), each on a ``DeviceMesh`` it makes.

- **FSDP2**: a 1-D mesh of every rank; ``fully_shard`` per block, then the root.
- **HSDP** (``hsdp=R``): a ``(replicate=R, shard=W/R)`` mesh: each parameter is sharded
  over the ``W/R`` ranks of a replica and copied across the ``R`` replicas (the multi-node
  layout: replicate across nodes, shard within one). Every rank still reads its own data.
- **FSDP2 + TP** (``tp=N``): a ``(dp=W/N, tp=N)`` mesh, ranks row-major (rank ``r`` is data
  rank ``r // N``, tensor-parallel rank ``r % N``). The torchtitan order: each block is
  ``parallelize_module``-d over ``mesh["tp"]`` with the caller's plan, then ``fully_shard``
  per block and root over ``mesh["dp"]``. The ``N`` tensor-parallel peers of a data rank
  must read the same micro-batches.

:class:`gradstep.Stepper` detects each result (``FSDP2Strategy`` for FSDP2 and HSDP,
``FSDP2TPStrategy`` for tensor parallel). HSDP with tensor parallel (a 3-D mesh) is refused.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .._validate import check_int

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["TPPlan", "apply_tp", "build_mesh", "check_layout", "fsdp_layout"]

TPPlan = Mapping[str, Any] | Callable[[nn.Module, Any], Any]
"""A tensor-parallel plan for one block: ``{module path relative to the block:
ParallelStyle}`` (``parallelize_module``'s dict; ``*`` matches like fnmatch), or a
callable ``plan(block, tp_mesh)`` that parallelizes the block itself."""


def check_layout(strategy: str, tp: int, tp_plan: TPPlan | None, hsdp: int) -> None:
    """Refuse, naming the argument, a layout ``prepare_model`` cannot build (no process
    group needed: the world size is checked when the mesh is built)."""
    check_int("tp", tp, 1, "prepare_model", ValueError)
    check_int("hsdp", hsdp, 1, "prepare_model", ValueError)
    for name, value in (("tp", tp), ("hsdp", hsdp)):
        if value > 1 and strategy != "fsdp":
            raise ValueError(
                f"prepare_model: {name}={value} needs strategy='fsdp' (it shards with FSDP2 "
                f"on a 2-D mesh), got strategy={strategy!r}; pass strategy='fsdp' or {name}=1"
            )
    if tp > 1 and hsdp > 1:
        raise ValueError(
            f"prepare_model: tp={tp} and hsdp={hsdp} together (a (replicate, shard, tp) mesh) "
            "are not supported: pass one of them"
        )
    if tp > 1 and tp_plan is None:
        raise ValueError(
            f"prepare_model: tp={tp} needs tp_plan=: a dict of module paths (relative to a "
            "block) to ParallelStyle, e.g. {'attn.qkv': ColwiseParallel(), 'attn.out': "
            "RowwiseParallel()}, or a callable(block, tp_mesh)"
        )
    if tp == 1 and tp_plan is not None:
        raise ValueError("prepare_model: tp_plan= is used with tp > 1 only; pass tp=N (N >= 2)")
    if tp_plan is not None and not (isinstance(tp_plan, Mapping) or callable(tp_plan)):
        raise ValueError(
            "prepare_model: tp_plan must be a dict {module path: ParallelStyle} or a "
            f"callable(block, tp_mesh), got {type(tp_plan).__name__}"
        )


def build_mesh(device: torch.device, tp: int = 1, hsdp: int = 1) -> DeviceMesh:
    """The mesh of the layout on every rank of the default group: ``(W,)``,
    ``(replicate=hsdp, shard=W/hsdp)`` or ``(dp=W/tp, tp=tp)``; on ``device``'s type (the
    model's: ``fully_shard``'s default would follow the machine's accelerator instead)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    for name, size in (("tp", tp), ("hsdp", hsdp)):
        if world % size:
            fits = [n for n in range(1, world + 1) if world % n == 0]
            raise ValueError(
                f"prepare_model: {name}={size} must divide the number of ranks ({world}): "
                f"one of {', '.join(map(str, fits))}"
            )
    if tp > 1:
        return init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if hsdp > 1:
        shape = (hsdp, world // hsdp)
        return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,))


def _resolves(module: nn.Module, path: str) -> bool:
    """Whether ``path`` names a submodule of ``module`` as ``parallelize_module`` reads it
    (dot-separated tokens, each an fnmatch pattern over child names; "" is the module)."""
    if path == "":
        return True
    token, _, rest = path.partition(".")
    children = [c for name, c in module.named_children() if fnmatch.fnmatch(name, token)]
    return any(_resolves(child, rest) for child in children)


def _check_plan(block: nn.Module, plan: Mapping[str, Any]) -> None:
    from torch.distributed.tensor.parallel import ParallelStyle

    for path, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise ValueError(
                f"prepare_model: tp_plan[{path!r}] must be a ParallelStyle (ColwiseParallel(),"
                f" RowwiseParallel(), ...), got {type(style).__name__}"
            )
        if not isinstance(path, str) or not _resolves(block, path):
            names = sorted(n for n, _ in block.named_modules() if n)
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(
                f"prepare_model: tp_plan key {path!r} names no module of the block "
                f"{type(block).__name__}; its modules are: {shown}"
            )


def apply_tp(blocks: list[nn.Module], tp_mesh: DeviceMesh, plan: TPPlan) -> None:
    """Parallelize every block over ``tp_mesh`` with ``plan`` (checked on every block
    first: nothing is changed when a key names no module)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if not blocks:
        raise ValueError(
            "prepare_model: tp= parallelizes each transformer block, and the model has no "
            "nn.ModuleList of blocks; pass blocks_attr= (e.g. 'transformer.h')"
        )
    if isinstance(plan, Mapping):
        for block in blocks:
            _check_plan(block, plan)
    for block in blocks:
        if isinstance(plan, Mapping):
            parallelize_module(block, tp_mesh, dict(plan))
        else:
            plan(block, tp_mesh)


def fsdp_layout(
    model: nn.Module,
    blocks: list[nn.Module],
    device: torch.device,
    policy: MixedPrecisionPolicy,
    *,
    tp: int = 1,
    tp_plan: TPPlan | None = None,
    hsdp: int = 1,
) -> nn.Module:
    """Build the mesh, apply tensor parallel (``tp > 1``), then ``fully_shard`` each block
    and the root over the data-parallel part of the mesh. The model is changed in place."""
    from torch.distributed.fsdp import fully_shard

    mesh = build_mesh(device, tp, hsdp)
    shard_mesh = mesh
    if tp > 1:
        apply_tp(blocks, mesh["tp"], tp_plan)  # type: ignore[arg-type]
        shard_mesh = mesh["dp"]
    for block in blocks:
        fully_shard(block, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    return model
