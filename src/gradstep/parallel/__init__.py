"""Everything that talks to ``torch.distributed``: strategies, collectives, setup.

- :mod:`.base`: the :class:`Strategy` protocol the step uses (a small core, plus declared
  capabilities);
- :mod:`.local`, :mod:`.ddp`, :mod:`.fsdp2`, :mod:`.tensor_parallel`: one file per strategy;
- :mod:`.collectives`: the one ``unwrap``, "is a group up", the collective device, sums,
  and ``agree(flag)`` (true on every rank when any rank's flag is: one all-reduce, one
  host read), which every "all ranks take the same branch" decision goes through;
- :mod:`.dtensor`: a DTensor's local part, ``counted`` (what this rank's part counts for in
  a sum over every rank), ``shard_groups`` (the process groups a whole-tensor sum crosses,
  on any mesh), norms in at least float32;
- :mod:`.layout`: :class:`Layout` (``dp_replicate``, ``dp_shard``, ``tp``, ``cp``, ``pp``) and
  the meshes ``prepare_model(model, "fsdp", layout=...)`` builds (HSDP, FSDP2 + tensor
  parallel, both);
- :mod:`.registry`: ``prepare_model`` and the strategy registry (``register_strategy``,
  ``strategy_for``);
- :mod:`.setup`: ``init`` from torchrun, ``shutdown``, ``find_blocks``;
- :mod:`.failures`: ``collective_failure``, the message for a rank that is stuck or gone;
- :mod:`.instrumentation`: counting gradient collectives, for tests and benchmarks only.

:func:`strategy_for` detects the strategy from the model's wrapper; ``Stepper(...,
strategy=...)`` takes one explicitly. The built-ins register like any other. A new strategy
is not one file: for a layout gradstep already builds it is its file here (a class with
``name``, ``detects(model)``, the core of :class:`Strategy` and the capabilities it
declares), one ``register_strategy(cls, prepare=...)`` call (which lets
``prepare_model(model, name)`` build it too) and its tests; a new mesh dim adds the
:class:`Layout` field (:mod:`.layout`), the memory model's per-rank sizes and, outside the
library, the CLI's flag. docs/library/distributed.md ("What a new strategy touches") lists
it as measured on tensor parallel and on HSDP + tensor parallel; docs/reference/strategy.md
lists every member of the protocol.
"""

from __future__ import annotations

from .base import (
    GRADIENT_LAYOUTS,
    BackendGradients,
    Capabilities,
    FinalGrads,
    ForwardCollectives,
    ModelParallel,
    ProcessGroupStrategy,
    RunsWindow,
    SelfReducedNorm,
    ShardReplicas,
    Strategy,
    capabilities,
    window_length_error,
)
from .collectives import (
    agree,
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
from .layout import Layout
from .local import LocalStrategy
from .registry import STRATEGIES, prepare_model, register_strategy, strategy_for
from .setup import (
    BACKENDS,
    DistEnv,
    find_blocks,
    init,
    launched_by_torchrun,
    quiet_unless_main,
    resolve_device,
    shutdown,
)
from .tensor_parallel import FSDP2TPStrategy

__all__ = [
    "BACKENDS",
    "GRADIENT_LAYOUTS",
    "BackendGradients",
    "Capabilities",
    "FinalGrads",
    "ForwardCollectives",
    "ModelParallel",
    "RunsWindow",
    "SelfReducedNorm",
    "ShardReplicas",
    "capabilities",
    "STRATEGIES",
    "TIMEOUT_RANGE_S",
    "DDPStrategy",
    "DistEnv",
    "FSDP2Strategy",
    "FSDP2TPStrategy",
    "Layout",
    "LocalStrategy",
    "ProcessGroupStrategy",
    "Strategy",
    "agree",
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
