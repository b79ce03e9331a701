"""Data-parallel setup with PyTorch's own engine: process group from torchrun, DDP or FSDP2.

gradstep does not reimplement any collective: DDP and FSDP2 (``fully_shard``) move the
gradients, and :class:`gradstep.Stepper` detects the wrapped model and keeps the step exact
(one global item count, the backends' average over ranks cancelled, sync only on the last
micro-batch, the norm reduced over every shard). This module is the small glue a training
script needs around that::

    env = gradstep.distributed.init()            # no-op outside torchrun
    model = build_model().to(env.device)
    model = gradstep.distributed.prepare_model(model, "fsdp", precision="bf16")
    ...                                          # Stepper(model, optimizer, ...) as usual
    gradstep.distributed.shutdown()

Only pure data parallelism over the whole world is supported: every rank holds a different
slice of the data and the full model (DDP) or a shard of it (FSDP2 over a 1-D mesh).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .precision import PRECISIONS

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = [
    "BACKENDS",
    "STRATEGIES",
    "CommCounter",
    "DistEnv",
    "count_gradient_comms",
    "find_blocks",
    "init",
    "is_initialized",
    "is_main",
    "launched_by_torchrun",
    "min_over_ranks",
    "prepare_model",
    "quiet_unless_main",
    "rank",
    "shutdown",
    "unwrap",
    "world_size",
]

STRATEGIES = ("none", "ddp", "fsdp")
BACKENDS = ("auto", "gloo", "nccl")
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


def _resolve_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """One device per process: ``cuda`` means this process's GPU, ``cuda:LOCAL_RANK``."""
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
        timeout_s: collective timeout; a rank that never joins a collective then raises
            after this long instead of waiting for torch's default (30 minutes for gloo).

    Outside torchrun this starts nothing and returns rank 0 of a world of 1, so one script
    runs both ways. Calling it again after the group exists just describes the group.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be None or a number > 0, got {timeout_s!r}")
    local = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0
    dev = _resolve_device(device, local)
    if dist.is_available() and dist.is_initialized():
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
    return DistEnv(dist.get_rank(), dist.get_world_size(), local, dev, chosen)


def is_initialized() -> bool:
    """True when a process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    """True on the one process that prints, logs and writes files."""
    return rank() == 0


def shutdown(barrier: bool = True) -> None:
    """Barrier, then destroy the process group; a no-op without one.

    The barrier keeps a fast rank from tearing its connections down while another is still
    in its last collective: gloo then sometimes aborts the slower process at exit. Pass
    ``barrier=False`` when leaving on an error: the other ranks may never reach it.
    """
    if not is_initialized():
        return
    try:
        if barrier:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def min_over_ranks(n: int) -> int:
    """The smallest ``n`` over all ranks (``n`` itself without a process group).

    For loops whose forward passes must line up across ranks (FSDP2 all-gathers in every
    forward): each rank runs only as many iterations as the rank with the fewest.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


@contextlib.contextmanager
def quiet_unless_main() -> Iterator[None]:
    """Silence stdout and stderr on every rank but 0, so N ranks print one log.

    Restored on exit, before an exception propagates, so a failing rank's traceback is
    still shown.
    """
    if is_main():
        yield
        return
    with open(os.devnull, "w") as devnull:
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = devnull
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 modifies the module in place)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


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

    if precision == "bf16":
        # bf16 all-gathers and compute; gradients reduced AND accumulated across no-sync
        # micro-batches in float32 (FSDP2 upcasts the unsharded gradient when
        # reduce_dtype differs), so partial sums are never rounded to bf16.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # fp32, and fp16 where autocast computes in fp16 from float32 shards (GradScaler needs
    # float32 gradients).
    return MixedPrecisionPolicy()


def prepare_model(
    model: nn.Module,
    strategy: str = "ddp",
    precision: str = "fp32",
    blocks_attr: str | None = None,
) -> nn.Module:
    """Wrap ``model`` (already on this process's device) for data parallelism.

    - ``"none"``: returned unchanged.
    - ``"ddp"``: ``DistributedDataParallel``; every rank keeps the full model.
    - ``"fsdp"``: FSDP2 ``fully_shard`` on each block (see :func:`find_blocks`) and then on
      the root, over all ranks; with ``precision="bf16"`` a ``MixedPrecisionPolicy`` with
      bf16 parameters and float32 gradient reduction. The model is modified in place.

    Pass the result to :class:`gradstep.Stepper`; it detects the wrapper.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if strategy == "none":
        return model
    if not is_initialized():
        raise RuntimeError(
            f"prepare_model(strategy={strategy!r}) needs a process group: launch with "
            "`torchrun --nproc_per_node=N ...` and call gradstep.distributed.init() first"
        )
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"model parameters must be on one device, found {sorted(map(str, devices))}"
        )
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device = next(iter(devices), torch.device("cpu"))
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    policy = _mixed_precision(precision)
    for block in find_blocks(model, blocks_attr):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


@dataclass
class CommCounter:
    """Gradient collectives issued by DDP (all-reduces) or FSDP2 (reduce-scatters).

    ``bytes`` is the size of each collective's input buffer (the full bucket for DDP, the
    full unsharded gradient of a parameter group for FSDP2), summed; what a ring algorithm
    sends per rank is about ``(world - 1) / world`` of it.
    """

    calls: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0

    def add(self, t: torch.Tensor) -> None:
        self.calls += 1
        self.bytes += t.numel() * t.element_size()


# Unannotated on purpose: DDP checks the hook's annotations against the real classes, and
# with postponed evaluation (``from __future__ import annotations``) they are strings.
def _ddp_counting_hook(counter, bucket):  # type: ignore[no-untyped-def]
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter.add(bucket.buffer())
    return allreduce_hook(None, bucket)  # DDP's own behaviour: average over the world


def _counting_reduce_scatter(counter: CommCounter) -> ReduceScatter:
    # FSDP2's comm interface is not re-exported publicly (torch 2.13); set_custom_reduce_scatter
    # is the public hook that takes it.
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class CountingReduceScatter(ReduceScatter):
        """FSDP2's default reduce-scatter, counted."""

        def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
            counter.add(input_tensor)
            return dist.reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )

    return CountingReduceScatter()


def count_gradient_comms(model: nn.Module) -> CommCounter:
    """Count the gradient collectives of a DDP or FSDP2 model from now on.

    DDP: a communication hook equal to DDP's default all-reduce (register before the first
    backward; DDP allows one hook). FSDP2: a reduce-scatter equal to the default, set on
    every FSDP module. Used by the tests and bench/distributed.py to show that gradients
    are reduced once per optimizer step, not once per micro-batch.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    counter = CommCounter()
    if isinstance(model, DistributedDataParallel):
        model.register_comm_hook(counter, _ddp_counting_hook)
    elif isinstance(model, FSDPModule):
        comm = _counting_reduce_scatter(counter)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(comm)
    else:
        raise TypeError(
            f"count_gradient_comms needs a DDP or FSDP2 model, got {type(model).__name__}"
        )
    return counter
