"""The strategy registry, for both ends: :func:`strategy_for` detects a wrapped model with it
and :func:`prepare_model` builds one by name from it. The built-ins register like any other
(as the clip policies do in :mod:`gradstep.policies.registry`)::

    register_strategy(MyStrategy, prepare=my_prepare)   # detects(model), and a name
    model = prepare_model(model, "mine")                 # my_prepare(model, precision=..., ...)
    gradstep.Stepper(model, optimizer)                   # strategy_for(model): MyStrategy(model)

``prepare_model(model, "fsdp", layout=Layout(...), tp_plan=...)`` builds FSDP2 on the mesh of
a :class:`~gradstep.parallel.layout.Layout`: HSDP (``dp_replicate``), tensor parallel
(``tp``) and both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._validate import check_choice
from .base import Strategy
from .collectives import is_initialized
from .ddp import DDPStrategy
from .fsdp2 import FSDP2Strategy
from .layout import Layout, TPPlan, check_layout, fsdp_layout
from .local import LocalStrategy
from .setup import find_blocks
from .tensor_parallel import FSDP2TPStrategy

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["STRATEGIES", "Prepare", "prepare_model", "register_strategy", "strategy_for"]

# The ``precision`` names prepare_model takes (Stepper(precision=)'s, kept here so that this
# layer imports nothing of the step), each with the dtype FSDP2 all-gathers and computes in
# (None: the parameters' own). fp16 keeps float32 shards: autocast computes in fp16 and
# GradScaler needs float32 gradients.
_FSDP_PARAM_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": None,
}

Prepare = Callable[..., nn.Module]
"""``prepare(model, *, precision, blocks_attr) -> model``: wraps a model for one strategy
(given ``layout=`` and ``tp_plan=`` too when the caller passes them; ``"fsdp"``'s takes
both)."""

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
    layout: Layout | None = None,
    tp_plan: TPPlan | None = None,
) -> nn.Module:
    """Wrap ``model`` (already on this process's device) for data parallelism.

    - ``"none"``: returned unchanged.
    - ``"ddp"``: ``DistributedDataParallel``; every rank keeps the full model.
    - ``"fsdp"``: FSDP2 ``fully_shard`` on each block (see :func:`find_blocks`) and then on
      the root, over the data-parallel dims of ``layout``'s mesh (default ``Layout()``: all
      ranks); with ``precision="bf16"`` a ``MixedPrecisionPolicy`` with bf16 parameters and
      float32 gradient reduction. The model is modified in place. ``layout``
      (:class:`~gradstep.parallel.layout.Layout`), ``"fsdp"`` only:

      - ``Layout(dp_replicate=R)``: HSDP on a ``(dp_replicate=R, dp_shard=W/R)`` mesh
        (replicate across nodes, shard within one); every rank reads its own data;
      - ``Layout(tp=N)`` with ``tp_plan``: FSDP2 + tensor parallel on a ``(dp_shard=W/N,
        tp=N)`` mesh, ranks row-major; each block is ``parallelize_module``-d over
        ``mesh["tp"]`` with ``tp_plan`` (``{path relative to a block: ParallelStyle}``, or a
        callable ``plan(block, tp_mesh)``), then sharded over the data-parallel dims. Rank
        ``r`` is data rank ``layout.data_rank(r) = r // N``: the N tensor-parallel peers
        must read the same micro-batches;
      - ``Layout(dp_replicate=R, tp=N)``: both, on a ``(R, W/(R N), N)`` mesh.

      The sizes must multiply to the number of ranks (``dp_shard=-1`` takes the rest).
    - a name given to :func:`register_strategy` with a ``prepare`` callable (``layout`` and
      ``tp_plan`` are passed to it when given).

    Pass the result to :class:`gradstep.Stepper`; it detects the wrapper (``FSDP2Strategy``
    for FSDP2 and HSDP, ``FSDP2TPStrategy`` with tensor parallel).
    """
    check_choice("strategy", strategy, tuple(_PREPARERS))
    check_choice("precision", precision, tuple(_FSDP_PARAM_DTYPES))
    check_layout(strategy, layout, tp_plan)
    given = {} if layout is None and tp_plan is None else {"layout": layout, "tp_plan": tp_plan}
    return _PREPARERS[strategy](model, precision=precision, blocks_attr=blocks_attr, **given)


def _mixed_precision(precision: str) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = _FSDP_PARAM_DTYPES[precision]
    if param_dtype is None:
        return MixedPrecisionPolicy()
    # Low-precision all-gathers and compute; gradients reduced AND accumulated across
    # no-sync micro-batches in float32 (FSDP2 upcasts the unsharded gradient when
    # reduce_dtype differs), so partial sums are never rounded to bf16.
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


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
    layout: Layout | None = None,
    tp_plan: TPPlan | None = None,
) -> nn.Module:
    device = _model_device(model, "fsdp")
    blocks = find_blocks(model, blocks_attr)
    policy = _mixed_precision(precision)
    return fsdp_layout(model, blocks, device, policy, layout or Layout(), tp_plan)


register_strategy(LocalStrategy, name="none", prepare=_prepare_none, fallback=True)
register_strategy(DDPStrategy, prepare=_prepare_ddp)
register_strategy(FSDP2Strategy, prepare=_prepare_fsdp)
register_strategy(FSDP2TPStrategy, first=True)  # an FSDP2 model too: asked before it

STRATEGIES = tuple(_PREPARERS)
"""The built-in strategies' names for :func:`prepare_model` (``none``, ``ddp``, ``fsdp``):
those registered with a ``prepare`` callable when this module loaded. A later
``register_strategy(..., prepare=...)`` is taken by ``prepare_model`` too."""
