"""Activation checkpointing per transformer block: keep each block's input, recompute the
rest in backward. Activation memory drops from every intermediate of every block to one
tensor per block, for about one extra forward pass of compute."""

from __future__ import annotations

from typing import Any

import torch.utils.checkpoint
from torch import nn

from ..parallel.setup import find_blocks

__all__ = ["checkpoint_blocks"]

_MARK = "_gradstep_checkpointed"


def checkpoint_blocks(model: nn.Module, blocks_attr: str | None = None) -> int:
    """Wrap the forward of every block of ``model`` in non-reentrant ``torch.utils.checkpoint``.

    Blocks are found like FSDP2's units (:func:`gradstep.parallel.find_blocks`: the children
    of the outermost ``nn.ModuleList``, or ``blocks_attr``). Call it before ``fully_shard`` /
    ``prepare_model``. Parameter names do not change, so checkpoints and ``AGC(exclude=)``
    names stay valid; the RNG state is replayed, so dropout masks are the same in the
    recompute and gradients equal the unwrapped model's. Wrapping twice is a no-op. Returns
    the number of blocks wrapped.
    """
    blocks = find_blocks(model, blocks_attr)
    if not blocks:
        raise ValueError(
            "checkpoint_blocks: the model has no nn.ModuleList of blocks; pass blocks_attr="
        )
    for block in blocks:
        if getattr(block, _MARK, False):
            continue
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward  # type: ignore[method-assign]
        setattr(block, _MARK, True)
    return len(blocks)
