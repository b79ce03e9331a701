"""The parallel layout: how the ranks of a job split the work, as one value, and the meshes
``prepare_model(model, "fsdp", layout=...)`` builds from it.

``Layout(dp_replicate=1, dp_shard=-1, tp=1, cp=1, pp=1)`` (torchtitan's ``ParallelDims``):

- ``dp_replicate`` x ``dp_shard``: the data-parallel ranks (:attr:`Layout.dp_size`: they read
  different data). FSDP2 shards each parameter over ``dp_shard`` ranks and copies it across
  ``dp_replicate`` replicas (HSDP when both are > 1). ``dp_shard=-1``: the ranks left.
- ``tp``: tensor-parallel peers; they hold parts of every block and read the same data.
- ``cp``, ``pp``: context and pipeline parallelism, not implemented (refused; design notes in
  docs/design/pipeline-parallel.md).

The mesh has the dims in use, named and ordered as torchtitan's, ranks row-major:
``("dp_replicate", "dp_shard", "tp")``, ``dp_replicate`` and ``tp`` only when > 1 (so
``Layout()`` on W ranks is FSDP2's 1-D ``("dp_shard",)`` mesh, ``Layout(dp_replicate=R)``
HSDP's ``(R, W/R)`` and ``Layout(tp=N)`` FSDP2 + tensor parallel's ``(W/N, N)``). Each block is
``parallelize_module``-d over ``mesh["tp"]`` with the caller's plan, then ``fully_shard``
(block by block, then the root) over the data-parallel dims. Rank ``r`` reads the data of
data-parallel rank ``r // tp`` (:meth:`Layout.data_rank`).

:class:`gradstep.Stepper` detects each result (``FSDP2Strategy`` for FSDP2 and HSDP,
``FSDP2TPStrategy`` with tensor parallel, HSDP included); :meth:`Layout.of` reads the layout
back from a prepared model.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._validate import check_int
from ..errors import UnsupportedSetup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["MESH_DIMS", "Layout", "TPPlan", "apply_tp", "check_layout", "fsdp_layout"]

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
"""The mesh's dim names, in mesh order (the ones in use: :attr:`Layout.dims`)."""

_FIELDS = ("dp_replicate", "dp_shard", "tp", "cp", "pp")
_NOT_IMPLEMENTED = {
    "cp": "context parallelism",
    "pp": "pipeline parallelism",
}

TPPlan = Mapping[str, Any] | Callable[[nn.Module, Any], Any]
"""A tensor-parallel plan for one block: ``{module path relative to the block:
ParallelStyle}`` (``parallelize_module``'s dict; ``*`` matches like fnmatch), or a
callable ``plan(block, tp_mesh)`` that parallelizes the block itself."""


@dataclass(frozen=True, repr=False)
class Layout:
    """How the ranks of a job split the work (see the module docs). Sizes are ints >= 1;
    ``dp_shard=-1`` means the ranks the others leave (:meth:`resolve` makes it concrete)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    cp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if name == "dp_shard" and value == -1:
                continue
            allowed = "an int >= 1, or -1 (the ranks left)" if name == "dp_shard" else "an int >= 1"
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout: {name} must be {allowed}, got {value!r}")
        for name, what in _NOT_IMPLEMENTED.items():
            if getattr(self, name) > 1:
                raise UnsupportedSetup(
                    f"Layout: {name}={getattr(self, name)} ({what}) is not implemented; "
                    f"{name} must be 1. What exact support would need: the design notes in "
                    f"docs/design/pipeline-parallel.md ('{what.capitalize()} (refused): "
                    "a design note')"
                )

    def __repr__(self) -> str:
        given = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]  # fmt: skip
        return f"Layout({', '.join(given)})"

    # ---------------------------------------------------------------- sizes
    @property
    def resolved(self) -> bool:
        """Every size is concrete (``dp_shard`` is not -1)."""
        return self.dp_shard != -1

    def resolve(self, world: int) -> Layout:
        """This layout on ``world`` ranks, ``dp_shard=-1`` made concrete: the sizes multiply
        to ``world``, or a ``ValueError`` names the sizes that do not fit."""
        check_int("world", world, 1, "Layout.resolve", ValueError)
        others = [(n, getattr(self, n)) for n in _FIELDS if n != "dp_shard"]
        fixed = math.prod(v for _, v in others)
        named = " x ".join(f"{n}={v}" for n, v in others if v > 1)
        if not self.resolved:
            if world % fixed:
                fits = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
                product = named if " x " not in named else f"{named} = {fixed}"
                raise ValueError(
                    f"{self!r} does not fit {world} ranks: {product} must divide the number "
                    f"of ranks ({world}), dp_shard=-1 taking the rest: one of {fits}"
                )
            return dataclasses.replace(self, dp_shard=world // fixed)
        if fixed * self.dp_shard != world:
            sizes = " x ".join(f"{n}={getattr(self, n)}" for n in _FIELDS[:3])
            raise ValueError(
                f"{self!r} does not fit {world} ranks: {sizes} = {fixed * self.dp_shard} must "
                f"equal the number of ranks ({world}); pass dp_shard=-1 to take the ranks left"
            )
        return self

    def _check_resolved(self, what: str) -> None:
        if not self.resolved:
            raise ValueError(
                f"Layout.{what}: {self!r} has dp_shard=-1 (the ranks left): call "
                "layout.resolve(world_size) first"
            )

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks, ``dp_replicate x dp_shard``: the ranks that read
        different data (the global batch is split over them)."""
        self._check_resolved("dp_size")
        return self.dp_replicate * self.dp_shard

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of each mesh dim in use, in mesh order: ``dp_replicate`` when > 1,
        ``dp_shard`` always (FSDP2 shards over it, even over 1 rank), ``tp`` when > 1."""
        self._check_resolved("dims")
        out = []
        if self.dp_replicate > 1:
            out.append(("dp_replicate", self.dp_replicate))
        out.append(("dp_shard", self.dp_shard))
        if self.tp > 1:
            out.append(("tp", self.tp))
        return tuple(out)

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The names of the data-parallel dims in use (what ``fully_shard`` shards over)."""
        return tuple(name for name, _ in self.dims if name != "tp")

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank whose micro-batches global rank ``rank`` reads: the mesh
        is row-major with ``tp`` innermost, so ranks ``d * tp`` to ``d * tp + tp - 1`` (the
        tensor-parallel peers of data rank ``d``) read the same data."""
        return rank // self.tp

    # ---------------------------------------------------------------- meshes
    def mesh(self, device: torch.device | str = "cpu") -> DeviceMesh:
        """The ``DeviceMesh`` of this layout over every rank of the default group, on
        ``device``'s type (the model's: ``fully_shard``'s default would follow the machine's
        accelerator instead); its dims are :attr:`dims`."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dims = self.resolve(dist.get_world_size()).dims
        names = tuple(name for name, _ in dims)
        sizes = tuple(size for _, size in dims)
        return init_device_mesh(torch.device(device).type, sizes, mesh_dim_names=names)

    @classmethod
    def of(cls, model: nn.Module, world: int | None = None) -> Layout:
        """The layout of a prepared model, read from its meshes: FSDP2's (``dp_replicate``,
        ``dp_shard``) and the tensor-parallel parameters' (``tp``: the ranks their mesh
        spans beyond FSDP2's). A model FSDP2 does not shard (DDP, one process) is replicated
        over the ``world`` ranks (default: the process group's)."""
        from .collectives import unwrap, world_size
        from .fsdp2 import FSDP2Strategy, fsdp_mesh_info

        world = world_size() if world is None else world
        model = unwrap(model)
        info = fsdp_mesh_info(model) if FSDP2Strategy.detects(model) else None
        if info is None:
            return cls(dp_replicate=world, dp_shard=1)
        replicas = int(getattr(info, "replicate_mesh_size", 1))
        dp = int(info.mesh.size())
        tp = max((int(m.size()) for m in _param_meshes(model)), default=dp) // dp
        return cls(dp_replicate=replicas, dp_shard=dp // replicas, tp=max(tp, 1))


def _param_meshes(model: nn.Module) -> list[Any]:
    return [p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")]


# -------------------------------------------------------------------- prepare_model's checks


def check_layout(strategy: str, layout: Layout | None, tp_plan: TPPlan | None) -> None:
    """Refuse, naming the argument, what ``prepare_model`` cannot build (no process group
    needed: the world size is checked when the mesh is built)."""
    if layout is not None and not isinstance(layout, Layout):
        raise ValueError(
            "prepare_model: layout must be a gradstep.parallel.Layout (e.g. Layout(tp=2), "
            f"Layout(dp_replicate=2)) or None, got {type(layout).__name__}"
        )
    if layout is not None and layout != Layout() and strategy != "fsdp":
        raise ValueError(
            f"prepare_model: layout={layout!r} needs strategy='fsdp' (it shards with FSDP2 "
            f"on a multi-dimensional mesh), got strategy={strategy!r}; pass strategy='fsdp' "
            "or no layout"
        )
    tp = 1 if layout is None else layout.tp
    if tp > 1 and tp_plan is None:
        raise ValueError(
            f"prepare_model: layout={layout!r} needs tp_plan=: a dict of module paths "
            "(relative to a block) to ParallelStyle, e.g. {'attn.qkv': ColwiseParallel(), "
            "'attn.out': RowwiseParallel()}, or a callable(block, tp_mesh)"
        )
    if tp == 1 and tp_plan is not None:
        raise ValueError(
            "prepare_model: tp_plan= is used with a layout of tp > 1 only; pass "
            "layout=Layout(tp=N) (N >= 2)"
        )
    if tp_plan is not None and not (isinstance(tp_plan, Mapping) or callable(tp_plan)):
        raise ValueError(
            "prepare_model: tp_plan must be a dict {module path: ParallelStyle} or a "
            f"callable(block, tp_mesh), got {type(tp_plan).__name__}"
        )


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
            "prepare_model: a layout with tp > 1 parallelizes each transformer block, and the "
            "model has no nn.ModuleList of blocks; pass blocks_attr= (e.g. 'transformer.h')"
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
    layout: Layout,
    tp_plan: TPPlan | None = None,
) -> nn.Module:
    """Build ``layout``'s mesh, apply tensor parallel (``tp > 1``), then ``fully_shard``
    each block and the root over the data-parallel dims. The model is changed in place;
    a layout that does not fit the ranks is refused before anything is built."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    layout = layout.resolve(dist.get_world_size())
    mesh = layout.mesh(device)
    if layout.tp > 1:
        apply_tp(blocks, mesh["tp"], tp_plan)  # type: ignore[arg-type]
    dp_mesh = mesh if layout.tp == 1 else mesh[layout.dp_dims]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model
