"""What a ``gradstep train`` run trains with: the optimizer ``--optimizer`` names and the
loss of its model. The planner (:mod:`gradstep_cli.plan.planning`, :mod:`.estimate`) builds
the same ones as the run (:mod:`.train`), so both import them from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gradstep import optim
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.models.hf import HFLoss, count_batch
from gradstep_cli.run.evaluation import LMLoss

__all__ = ["build_optimizer", "loss_for"]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``cfg.optimizer`` with decay on matrices/embeddings only: decaying norm gains just
    hurts, and LARS/LAMB do not adapt them either (gradstep.optim.param_groups)."""
    groups = optim.param_groups(model, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lars":
        return optim.LARS(groups, lr=cfg.lr, momentum=0.9)
    if cfg.optimizer == "lamb":
        return optim.LAMB(groups, lr=cfg.lr)  # no internal clip: the Stepper clips
    # torch's optimizers: the same two groups, without the LARS/LAMB-only key.
    groups = [{k: v for k, v in g.items() if k != "always_adapt"} for g in groups]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def loss_for(cfg: TrainConfig, device: torch.device) -> tuple[Callable, Callable | None]:
    """(loss_fn, count) of the run's model: an HF model's may hold a router aux term."""
    return (HFLoss(device), count_batch) if cfg.is_hf else (LMLoss(device), None)
