"""What a ``gradstep train`` run trains with: the optimizer ``--optimizer`` names and the
loss of its model. The planner (:mod:`gradstep_cli.plan.planning`, :mod:`.estimate`) builds
the same ones as the run (:mod:`.train`), so both import them from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradstep import LossSum, optim
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.packed import row_kwargs
from gradstep_cli.data.sources import Batch
from gradstep_cli.models.hf import HFLoss, count_batch
from gradstep_cli.run.evaluation import LMLoss

__all__ = ["GPTLoss", "build_optimizer", "describe_optimizer", "loss_for", "optimizer_line"]

MOMENTUM = 0.9
"""SGD's and LARS's momentum."""
SHOWN = ("lr", "betas", "eps", "momentum", "amsgrad", "trust_coeff", "bias_correction")
"""The hyperparameters of the start line (summary.json has them all)."""


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``cfg.optimizer`` with decay on matrices/embeddings only: decaying norm gains just
    hurts, and LARS/LAMB do not adapt them either (gradstep.optim.param_groups). AdamW and
    LAMB take ``--adam-betas`` / ``--adam-eps`` (resolved by the config)."""
    groups = optim.param_groups(model, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lars":
        return optim.LARS(groups, lr=cfg.lr, momentum=MOMENTUM)
    if cfg.optimizer == "lamb":  # no internal clip: the Stepper clips
        return optim.LAMB(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps)
    # torch's optimizers: the same two groups, without the LARS/LAMB-only key.
    groups = [{k: v for k, v in g.items() if k != "always_adapt"} for g in groups]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=MOMENTUM)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps)


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What the run's optimizer is and runs with: its class, every hyperparameter it was
    built with (``defaults``; ``lr`` is the peak, the schedule sets each step's), and its
    parameter groups (tensors, values, weight decay). For summary.json and the start line."""
    defaults = {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in optimizer.defaults.items()
        # weight decay is the groups' (below): the constructor's default is not used
        if k != "weight_decay" and isinstance(v, (bool, int, float, str, tuple, type(None)))
    }
    kind = type(optimizer)
    groups = [
        {
            "tensors": len(g["params"]),
            "values": sum(p.numel() for p in g["params"]),
            "weight_decay": g.get("weight_decay", 0.0),
        }
        for g in optimizer.param_groups
    ]
    return {"class": f"{kind.__module__}.{kind.__qualname__}", **defaults, "groups": groups}


def optimizer_line(described: dict[str, Any]) -> str:
    """The start line: the class and the hyperparameters that shape its step."""
    shown = [
        f"{k} {tuple(v) if isinstance(v, list) else v}"
        for k in SHOWN
        if (v := described.get(k)) is not None
    ]
    groups = ", ".join(
        f"{g['weight_decay']:g} on {g['tensors']} tensors ({g['values']:,} values)"
        for g in described["groups"]
    )
    name = described["class"].rsplit(".", 1)[-1]
    return f"optimizer: {name}, {', '.join(shown)}; weight decay {groups}"


@dataclass(frozen=True)
class GPTLoss:
    """``loss_fn`` of the demo GPT with ``--loss-chunk-tokens N``: the loss computed in its
    forward (``model(ids, labels)``), ``GPTConfig.loss_chunk_tokens`` positions at a time,
    so the whole logits are never held (and under FSDP2 the head's gathered weight is
    the one the forward holds)."""

    device: torch.device

    def __call__(self, model: nn.Module, batch: Batch) -> LossSum:
        ids = batch["input_ids"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        return model(ids, labels, **row_kwargs(batch, self.device))


def loss_for(cfg: TrainConfig, device: torch.device) -> tuple[Callable, Callable | None]:
    """(loss_fn, count) of the run's model: an HF model's may hold a router aux term.
    ``--loss-chunk-tokens N`` (not 0): the chunked loss (:class:`GPTLoss`, the demo GPT
    built with ``loss_chunk_tokens``; :class:`HFLoss` ``chunk_tokens``)."""
    if cfg.is_hf:
        return HFLoss(device, cfg.loss_chunk_tokens), count_batch
    return (GPTLoss(device) if cfg.loss_chunk_tokens else LMLoss(device)), None
