"""A single process: nothing to synchronise, nothing to reduce."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .base import post_accumulate_hooks

__all__ = ["LocalStrategy"]


class LocalStrategy:
    """One process holding the whole model and its own data: the core of the protocol,
    and :class:`~gradstep.parallel.base.FinalGrads` (autograd's own hooks)."""

    name = "none"
    world_size = 1
    distributed = False
    grad_divisor = 1.0
    gradient_layout = "replicated"

    @staticmethod
    def detects(model: nn.Module) -> bool:
        return True  # any model: the fallback, asked last

    def micro_batch(self, micro_batch: Any, is_last: bool) -> contextlib.nullcontext:
        return contextlib.nullcontext(micro_batch)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float64)

    def final_grads(self, params: Sequence[nn.Parameter], record: Callable) -> Any:
        """``record(param, grad)`` once autograd has accumulated its final gradient."""
        return post_accumulate_hooks(params, record)
