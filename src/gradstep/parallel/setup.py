"""Data-parallel setup with PyTorch's own engine: process group from torchrun, DDP or FSDP2.

gradstep does not reimplement any collective: DDP and FSDP2 (``fully_shard``) move the
gradients, and :class:`gradstep.Stepper` detects the wrapped model and keeps the step exact
(one global item count, the backends' average over ranks cancelled, sync only on the last
micro-batch, the norm reduced over every shard). This module is the small glue a training
script needs around that::

    env = gradstep.parallel.init()               # no-op outside torchrun
    model = build_model().to(env.device)
    model = gradstep.parallel.prepare_model(model, "fsdp", precision="bf16")
    ...                                          # Stepper(model, optimizer, ...) as usual
    gradstep.parallel.shutdown()

Data parallelism over the whole world (every rank holds a different slice of the data and
the full model (DDP) or a shard of it (FSDP2 over a 1-D mesh)), HSDP (``hsdp=R``) and FSDP2
+ tensor parallel (``tp=N``): see :func:`prepare_model` and :mod:`.layouts`.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .._validate import check_choice
from . import collectives
from .base import Strategy
from .collectives import is_initialized
from .ddp import DDPStrategy
from .failures import check_timeout, remember_timeout
from .fsdp2 import FSDP2Strategy, release_dtensor_caches
from .layouts import TPPlan, check_layout, fsdp_layout
from .local import LocalStrategy
from .tensor_parallel import FSDP2TPStrategy

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "BACKENDS",
    "STRATEGIES",
    "DistEnv",
    "find_blocks",
    "init",
    "launched_by_torchrun",
    "prepare_model",
    "quiet_unless_main",
    "register_strategy",
    "resolve_device",
    "shutdown",
    "strategy_for",
]

BACKENDS = ("auto", "gloo", "nccl")
# The ``precision`` names prepare_model takes (Stepper(precision=)'s, kept here so that this
# layer imports nothing of the step), each with the dtype FSDP2 all-gathers and computes in
# (None: the parameters' own). fp16 keeps float32 shards: autocast computes in fp16 and
# GradScaler needs float32 gradients.
_FSDP_PARAM_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": None,
}
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits. ``backend`` is None for a plain single process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True when torchrun (or another env:// launcher) set RANK, WORLD_SIZE and LOCAL_RANK."""
    return all(name in os.environ for name in _TORCHRUN_VARS)


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def resolve_device(
    device: str | torch.device | None = None, local_rank: int | None = None
) -> torch.device:
    """One device per process: ``cuda`` means this process's GPU, ``cuda:LOCAL_RANK``.

    ``None``/``"auto"`` is CUDA when available, else CPU. ``local_rank`` defaults to
    torchrun's ``LOCAL_RANK`` (0 outside torchrun).
    """
    if local_rank is None:
        local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank)
    return dev


def init(
    device: str | torch.device | None = None,
    backend: str = "auto",
    timeout_s: float | None = None,
) -> DistEnv:
    """Initialise the default process group from torchrun's environment (``env://``).

    Args:
        device: ``None``/``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``
            (this process's GPU, ``cuda:LOCAL_RANK``) or an explicit device.
        backend: ``"auto"`` picks NCCL for CUDA and gloo for CPU.
        timeout_s: collective timeout in seconds, from 1 to 604800 (7 days); a rank that
            never joins a collective then raises after this long instead of waiting for
            torch's default (30 minutes for gloo, 10 for NCCL). :func:`collective_failure`
            turns that error into a message naming it.

    Outside torchrun this starts nothing and returns rank 0 of a world of 1, so one script
    runs both ways. Calling it again after the group exists just describes the group.
    """
    check_choice("backend", backend, BACKENDS)
    check_timeout(timeout_s)
    local = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0
    dev = resolve_device(device, local)
    if is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), local, dev, dist.get_backend())
    if not launched_by_torchrun():
        return DistEnv(0, 1, 0, dev, None)
    if not dist.is_available():
        raise RuntimeError("launched by torchrun, but this torch build has no torch.distributed")
    chosen = ("nccl" if dev.type == "cuda" else "gloo") if backend == "auto" else backend
    if chosen == "nccl" and dev.type != "cuda":
        raise ValueError(f"backend 'nccl' needs a CUDA device, got device {str(dev)!r}")
    if dev.type == "cuda":
        # Before the group exists, so NCCL binds this process to its own GPU.
        torch.cuda.set_device(dev)
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group(chosen, **kwargs)
    remember_timeout(timeout_s)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local, dev, chosen)


def shutdown(barrier: bool = True) -> None:
    """Barrier, then destroy the process group and its backend; a no-op without one.

    The barrier keeps a fast rank from tearing its connections down while another is still
    in its last collective: gloo then sometimes aborts the slower process at exit. Pass
    ``barrier=False`` when leaving on an error: the other ranks may never reach it.

    Before destroying, what still holds the group once training is over is released
    (garbage: an FSDP2 model from a finished function, in reference cycles; DTensor's
    caches of the FSDP2 mesh), so the backend's threads and connections end here, while
    the interpreter is whole, not at its exit (a rare SIGABRT there). A model you still
    reference keeps the group alive: drop it (``del model``) before calling this.
    """
    if not is_initialized():
        return
    try:
        if barrier:
            dist.barrier()
    finally:
        release_dtensor_caches()
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def quiet_unless_main() -> Iterator[None]:
    """Silence stdout and stderr on every rank but 0, so N ranks print one log.

    Restored on exit, before an exception propagates, so a failing rank's traceback is
    still shown.
    """
    if collectives.is_main():
        yield
        return
    with open(os.devnull, "w") as devnull:
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = devnull
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved


def find_blocks(model: nn.Module, blocks_attr: str | None = None) -> list[nn.Module]:
    """The modules FSDP2 shards one by one (each becomes one all-gather/reduce-scatter group).

    ``blocks_attr`` names a ``ModuleList``/``Sequential`` (dotted paths allowed, e.g.
    ``"transformer.h"``). Without it, the children of every outermost ``nn.ModuleList`` are
    used: transformer implementations keep their repeated blocks in one. An empty list
    means the whole model is a single group (sharded at the root only).
    """
    if blocks_attr is not None:
        try:
            container = model.get_submodule(blocks_attr)
        except AttributeError:
            raise ValueError(
                f"blocks_attr={blocks_attr!r}: the model has no submodule of that name"
            ) from None
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise ValueError(
                f"blocks_attr={blocks_attr!r} must name an nn.ModuleList or nn.Sequential, "
                f"got {type(container).__name__}"
            )
        return list(container)
    found: list[str] = []
    blocks: list[nn.Module] = []
    for name, module in model.named_modules():
        inside = any(p == "" or name.startswith(p + ".") for p in found)
        if isinstance(module, nn.ModuleList) and not inside:
            found.append(name)
            blocks.extend(module)
    return blocks


def _mixed_precision(precision: str) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = _FSDP_PARAM_DTYPES[precision]
    if param_dtype is None:
        return MixedPrecisionPolicy()
    # Low-precision all-gathers and compute; gradients reduced AND accumulated across
    # no-sync micro-batches in float32 (FSDP2 upcasts the unsharded gradient when
    # reduce_dtype differs), so partial sums are never rounded to bf16.
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


# ------------------------------------------------------------ the strategy registry

Prepare = Callable[..., nn.Module]
"""``prepare(model, *, precision, blocks_attr) -> model``: wraps a model for one layout
(``"fsdp"``'s also takes ``tp``, ``tp_plan`` and ``hsdp``)."""

# strategy_for asks these, in order; the first whose ``detects(model)`` is true wraps it.
_DETECTORS: list[type] = []
# prepare_model's names, in registration order.
_PREPARERS: dict[str, Prepare] = {}
# The strategy of a model no class detects (built with no argument).
_FALLBACK: list[type] = []


def register_strategy(
    cls: type,
    first: bool = False,
    *,
    name: str | None = None,
    prepare: Prepare | None = None,
    fallback: bool = False,
) -> type:
    """Let :func:`strategy_for` detect ``cls`` and, with ``prepare``, let
    :func:`prepare_model` build it by name. Returns ``cls``, so it also works as a decorator.

    - ``cls``: a class with ``detects(model) -> bool`` and a ``cls(model)`` constructor;
      ``first`` puts it before the classes registered so far (the built-ins).
    - ``prepare``: ``prepare(model, *, precision, blocks_attr) -> model``, what
      ``prepare_model(model, name, ...)`` calls; ``name`` defaults to ``cls.name``.
    - ``fallback``: ``cls()`` is the strategy of a model no class detects (no ``detects``
      needed); the built-in fallback is :class:`LocalStrategy`.
    """
    if not fallback and not callable(getattr(cls, "detects", None)):
        raise TypeError(f"register_strategy: {cls!r} needs a detects(model) staticmethod")
    key = name if name is not None else getattr(cls, "name", None)
    if prepare is not None:  # checked before anything is registered: all or nothing
        if not isinstance(key, str) or not key:
            raise TypeError(f"register_strategy: {cls!r} needs a name (str) for prepare_model")
        if key in _PREPARERS:
            raise ValueError(f"register_strategy: the name {key!r} is already registered")
        _PREPARERS[key] = prepare
    if fallback:
        _FALLBACK[:] = [cls]
    else:
        _DETECTORS.insert(0, cls) if first else _DETECTORS.append(cls)
    return cls


def strategy_for(model: nn.Module) -> Strategy:
    """The strategy for ``model``'s wrapper (DDP, FSDP2, a registered one), else local."""
    for cls in _DETECTORS:
        if cls.detects(model):
            factory: Callable[[nn.Module], Strategy] = cls
            return factory(model)
    return _FALLBACK[0]()


def prepare_model(
    model: nn.Module,
    strategy: str = "ddp",
    precision: str = "fp32",
    blocks_attr: str | None = None,
    *,
    tp: int = 1,
    tp_plan: TPPlan | None = None,
    hsdp: int = 1,
) -> nn.Module:
    """Wrap ``model`` (already on this process's device) for data parallelism.

    - ``"none"``: returned unchanged.
    - ``"ddp"``: ``DistributedDataParallel``; every rank keeps the full model.
    - ``"fsdp"``: FSDP2 ``fully_shard`` on each block (see :func:`find_blocks`) and then on
      the root, over all ranks; with ``precision="bf16"`` a ``MixedPrecisionPolicy`` with
      bf16 parameters and float32 gradient reduction. The model is modified in place.
      Two 2-D layouts (:mod:`gradstep.parallel.layouts`), ``"fsdp"`` only:

      - ``hsdp=R``: HSDP, a ``(replicate=R, shard=W/R)`` mesh (replicate across nodes,
        shard within one); every rank reads its own data;
      - ``tp=N`` with ``tp_plan``: FSDP2 + tensor parallel on a ``(dp=W/N, tp=N)`` mesh,
        ranks row-major; each block is ``parallelize_module``-d over ``mesh["tp"]`` with
        ``tp_plan`` (``{path relative to a block: ParallelStyle}``, or a callable
        ``plan(block, tp_mesh)``), then sharded over ``mesh["dp"]``. Rank ``r`` is data rank
        ``r // N``: the N tensor-parallel peers must read the same micro-batches.

      ``tp`` and ``hsdp`` must divide the number of ranks; they do not combine.
    - a name given to :func:`register_strategy` with a ``prepare`` callable.

    Pass the result to :class:`gradstep.Stepper`; it detects the wrapper (``FSDP2Strategy``
    for FSDP2 and HSDP, ``FSDP2TPStrategy`` with tensor parallel).
    """
    check_choice("strategy", strategy, tuple(_PREPARERS))
    check_choice("precision", precision, tuple(_FSDP_PARAM_DTYPES))
    check_layout(strategy, tp, tp_plan, hsdp)
    layout = {} if tp == hsdp == 1 else {"tp": tp, "tp_plan": tp_plan, "hsdp": hsdp}
    return _PREPARERS[strategy](model, precision=precision, blocks_attr=blocks_attr, **layout)


def _model_device(model: nn.Module, strategy: str) -> torch.device:
    """The one device of ``model``'s parameters, once a process group exists."""
    if not is_initialized():
        raise RuntimeError(
            f"prepare_model(strategy={strategy!r}) needs a process group: launch with "
            "`torchrun --nproc_per_node=N ...` and call gradstep.parallel.init() first"
        )
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"model parameters must be on one device, found {sorted(map(str, devices))}"
        )
    return next(iter(devices), torch.device("cpu"))


def _prepare_none(model: nn.Module, **_: object) -> nn.Module:
    return model


def _prepare_ddp(model: nn.Module, **_: object) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device = _model_device(model, "ddp")
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def _prepare_fsdp(
    model: nn.Module,
    *,
    precision: str,
    blocks_attr: str | None,
    tp: int = 1,
    tp_plan: TPPlan | None = None,
    hsdp: int = 1,
) -> nn.Module:
    device = _model_device(model, "fsdp")
    blocks = find_blocks(model, blocks_attr)
    policy = _mixed_precision(precision)
    return fsdp_layout(model, blocks, device, policy, tp=tp, tp_plan=tp_plan, hsdp=hsdp)


register_strategy(LocalStrategy, name="none", prepare=_prepare_none, fallback=True)
register_strategy(DDPStrategy, prepare=_prepare_ddp)
register_strategy(FSDP2Strategy, prepare=_prepare_fsdp)
register_strategy(FSDP2TPStrategy, first=True)  # an FSDP2 model too: asked before it

STRATEGIES = tuple(_PREPARERS)
"""The built-in strategies' names for :func:`prepare_model` (``none``, ``ddp``, ``fsdp``):
those registered with a ``prepare`` callable when this module loaded. A later
``register_strategy(..., prepare=...)`` is taken by ``prepare_model`` too."""
