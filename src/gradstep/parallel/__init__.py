"""Everything that talks to ``torch.distributed``: strategies, collectives, setup.

- :mod:`.base`: the :class:`Strategy` protocol the step uses;
- :mod:`.local`, :mod:`.ddp`, :mod:`.fsdp2`: one file per strategy;
- :mod:`.collectives`: the one ``unwrap``, "is a group up", the collective device, sums;
- :mod:`.setup`: ``init`` from torchrun, ``prepare_model``, ``shutdown``;
- :mod:`.failures`: ``collective_failure``, the message for a rank that is stuck or gone;
- :mod:`.instrumentation`: counting gradient collectives, for tests and benchmarks only.

:func:`strategy_for` detects the strategy from the model's wrapper; ``Stepper(...,
strategy=...)`` takes one explicitly. A new layout (tensor parallel, HSDP) is a new file
whose class has ``detects(model)``, plus one :func:`register_strategy` call.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .base import ProcessGroupStrategy, Strategy, window_length_error
from .collectives import (
    all_reduce_sum,
    barrier,
    broadcast_from_rank0,
    comm_device,
    is_initialized,
    is_main,
    min_over_ranks,
    rank,
    unwrap,
    world_size,
)
from .ddp import DDPStrategy
from .failures import TIMEOUT_RANGE_S, collective_failure
from .fsdp2 import FSDP2Strategy
from .local import LocalStrategy
from .setup import (
    BACKENDS,
    STRATEGIES,
    DistEnv,
    find_blocks,
    init,
    launched_by_torchrun,
    prepare_model,
    quiet_unless_main,
    resolve_device,
    shutdown,
)

__all__ = [
    "BACKENDS",
    "STRATEGIES",
    "TIMEOUT_RANGE_S",
    "DDPStrategy",
    "DistEnv",
    "FSDP2Strategy",
    "LocalStrategy",
    "ProcessGroupStrategy",
    "Strategy",
    "all_reduce_sum",
    "barrier",
    "broadcast_from_rank0",
    "collective_failure",
    "comm_device",
    "find_blocks",
    "init",
    "is_initialized",
    "is_main",
    "launched_by_torchrun",
    "min_over_ranks",
    "prepare_model",
    "quiet_unless_main",
    "rank",
    "register_strategy",
    "resolve_device",
    "shutdown",
    "strategy_for",
    "unwrap",
    "window_length_error",
    "world_size",
]

# Checked in order; the first class whose ``detects(model)`` is true wraps the model.
_DETECTORS: list[type] = [DDPStrategy, FSDP2Strategy]


def register_strategy(cls: type, first: bool = False) -> type:
    """Let :func:`strategy_for` detect ``cls`` (a class with ``detects(model) -> bool`` and a
    ``cls(model)`` constructor). ``first`` puts it before the built-ins. Returns ``cls``,
    so it also works as a decorator."""
    if not callable(getattr(cls, "detects", None)):
        raise TypeError(f"register_strategy: {cls!r} needs a detects(model) staticmethod")
    _DETECTORS.insert(0, cls) if first else _DETECTORS.append(cls)
    return cls


def strategy_for(model: nn.Module) -> Strategy:
    """The strategy for ``model``'s wrapper (DDP, FSDP2, a registered one), else local."""
    for cls in _DETECTORS:
        if cls.detects(model):
            factory: Callable[[nn.Module], Strategy] = cls
            return factory(model)
    return LocalStrategy()
