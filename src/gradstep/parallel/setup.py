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

``prepare_model`` and the strategy registry live in :mod:`.registry`; the layouts it builds
(HSDP, FSDP2 + tensor parallel, both) in :mod:`.layout`.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .._validate import check_choice
from . import collectives
from .collectives import is_initialized
from .failures import check_timeout, remember_timeout
from .fsdp2 import release_dtensor_caches

__all__ = [
    "BACKENDS",
    "DistEnv",
    "find_blocks",
    "init",
    "launched_by_torchrun",
    "quiet_unless_main",
    "resolve_device",
    "shutdown",
]

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
