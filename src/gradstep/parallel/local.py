"""A single process: nothing to synchronise, nothing to reduce."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .base import local_norm, post_accumulate_hooks

__all__ = ["LocalStrategy"]


class LocalStrategy:
    """One process holding the whole model and its own data."""

    name = "none"
    world_size = 1
    dp_group = None
    distributed = False
    grad_divisor = 1.0
    gradient_layout = "replicated"
    norm_weight = 1.0
    agree_ranks = 1
    forward_communicates = False

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def agree_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def total_norm(self, grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        return local_norm(grads, norm_type)

    def final_grads(self, params: Sequence[nn.Parameter], record: Callable) -> Any:
        """``record(param, grad)`` once autograd has accumulated its final gradient."""
        return post_accumulate_hooks(params, record)

    def check_window(self, n: int) -> None:
        return None

    def discard_partial_grads(self) -> None:
        return None

    def hook_targets(
        self, named: Sequence[tuple[str, nn.Parameter]]
    ) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        return [(n, p, p) for n, p in named]

    def communicating_modules(self) -> list[nn.Module]:
        return []
