"""Pieces of the LARS/LAMB tests shared by one process and the ranks of ``run_ranks``:
a small model with uneven shards, a deterministic run through the Stepper, and the
per-rank scenarios (FSDP2 and DDP against one process, collectives, checkpoints)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradstep import Checkpointer, ClipNorm, LossSum, Stepper
from gradstep.optim import LAMB, LARS, param_groups

ROWS = 8  # rows per window, split over the ranks


class Net(nn.Module):
    """Matrices that shard evenly (16 x 8) and unevenly (5 x 16), vectors, and a
    one-element gain whose shard on rank 1 is empty."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 5)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * self.b(self.norm(torch.tanh(self.a(x))))


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay=0.01)
    if kind == "lars":
        return LARS(groups, lr=0.1, momentum=0.9, nesterov=True, trust_coeff=0.02)
    return LAMB(groups, lr=0.02, trust_clip=True)


def loss_fn(model: nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    x, y = mb
    return LossSum((model(x) - y).square().sum(), y.shape[0])


def window(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s micro-batches (one row each), the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(ROWS, 8, generator=gen), 3 * torch.randn(ROWS, 5, generator=gen)
    return [(x[i : i + 1], y[i : i + 1]) for i in range(ROWS)]


def run(stepper: Stepper, steps: range, rank: int = 0, world: int = 1) -> None:
    for step in steps:
        stepper.step(window(step)[rank::world], loss_fn)


def stepper_for(model: nn.Module, kind: str) -> Stepper:
    # Clipping on: the optimizers get gradients the Stepper already clipped.
    return Stepper(model, make_optimizer(kind, model), clip=ClipNorm(2.0))


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [full(p) for p in model.parameters()]


def _fsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.a)
    fully_shard(model)
    return model


def _count_step_collectives(stepper: Stepper) -> int:
    """Collectives of the optimizer's own step (CommDebugMode sees c10d and DTensor's)."""
    from torch.distributed.tensor.debug import CommDebugMode

    opt = stepper.optimizer
    counts: list[int] = []
    inner = opt.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        with CommDebugMode() as mode:
            out = inner(*args, **kwargs)
        counts.append(mode.get_total_counts())
        return out

    opt.step = counted  # type: ignore[method-assign]
    run(stepper, range(2), *_rank_world())
    opt.step = inner  # type: ignore[method-assign]
    return max(counts)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def scenarios(rank: int, world: int, folder: str) -> dict[str, Any]:
    """On every rank: each optimizer under FSDP2 and DDP, 6 steps, against one process;
    collectives per step; a FSDP2 checkpoint at step 3 resumed bit for bit."""
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    for kind in ("lars", "lamb"):
        torch.manual_seed(0)
        ref = Net()
        base = copy.deepcopy(ref)
        local = stepper_for(ref, kind)
        run(local, range(6))
        out[f"{kind}/one"] = weights(ref)
        sharded = stepper_for(_fsdp(copy.deepcopy(base)), kind)
        run(sharded, range(6), rank, world)
        out[f"{kind}/fsdp"] = weights(sharded.model)
        ddp = stepper_for(DistributedDataParallel(copy.deepcopy(base)), kind)
        run(ddp, range(6), rank, world)
        out[f"{kind}/ddp"] = weights(ddp.model.module)
        out[f"{kind}/fsdp_collectives"] = _count_step_collectives(
            stepper_for(_fsdp(copy.deepcopy(base)), kind)
        )
        out[f"{kind}/ddp_collectives"] = _count_step_collectives(
            stepper_for(DistributedDataParallel(copy.deepcopy(base)), kind)
        )
        out[f"{kind}/resume"] = _resume(kind, base, Path(folder, kind), rank, world)
    return out


def _resume(kind: str, base: nn.Module, folder: Path, rank: int, world: int) -> bool:
    """Steps 0-5 straight equal steps 0-2, save, a fresh model and optimizer, load, 3-5."""
    straight = stepper_for(_fsdp(copy.deepcopy(base)), kind)
    run(straight, range(6), rank, world)
    first = stepper_for(_fsdp(copy.deepcopy(base)), kind)
    run(first, range(3), rank, world)
    Checkpointer(folder).save(3, model=first.model, optimizer=first.optimizer, stepper=first)
    torch.manual_seed(99)  # other initial weights: the load must replace all of them
    second = stepper_for(_fsdp(Net()), kind)
    Checkpointer(folder).load_latest(model=second.model, optimizer=second.optimizer,
                                     stepper=second)  # fmt: skip
    run(second, range(3, 6), rank, world)
    return all(
        torch.equal(a, b)
        for a, b in zip(weights(straight.model), weights(second.model), strict=True)
    )
