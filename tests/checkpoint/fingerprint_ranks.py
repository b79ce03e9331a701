"""Rank functions and the model of the base-fingerprint tests (``run_ranks`` imports them by
name): a small adapter model, a frozen base and trainable adapters in every block, like a
PEFT LoRA model without needing transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradstep.parallel as gd
from gradstep.checkpoint import Checkpointer, CheckpointError, base_fingerprint

WIDTH = 8


class Block(nn.Module):
    """``base(x) + up(down(x))``: ``base`` frozen, the low-rank ``down``/``up`` trained."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, 2, bias=False)
        self.up = nn.Linear(2, WIDTH, bias=False)
        self.base.requires_grad_(False)
        self.register_buffer("scale", torch.ones(WIDTH))  # a buffer: not in the fingerprint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.base(x) + self.up(self.down(x))) * self.scale


class Adapted(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, WIDTH)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x


def adapted(base_seed: int = 0, adapter_seed: int = 100, dtype: Any = torch.float32) -> Adapted:
    """The base drawn from ``base_seed``, the adapters from ``adapter_seed``."""
    torch.manual_seed(base_seed)
    model = Adapted().to(dtype)
    gen = torch.Generator().manual_seed(adapter_seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters as full tensors (every rank calls it under FSDP2)."""
    out = {}
    for name, p in gd.unwrap(model).named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().clone()
    return out


def _load(folder: str, model: nn.Module) -> str | None:
    """Load the newest checkpoint into ``model``; the error's message, or None."""
    try:
        Checkpointer(folder, trainable_only=True).load_latest(model=model)
    except CheckpointError as exc:
        return str(exc)
    return None


def save_and_check(rank: int, world: int, folder: str, strategy: str) -> dict[str, Any]:
    """On ``world`` ranks with ``strategy``: the fingerprint of the wrapped base, a
    ``trainable_only`` save, then loads onto the same base (accepted) and onto a base of
    another seed (refused on every rank, the adapters untouched)."""
    model = gd.prepare_model(adapted(0, adapter_seed=5), strategy)
    digest = base_fingerprint(model).digest
    Checkpointer(Path(folder), trainable_only=True).save(1, model=model)
    same = gd.prepare_model(adapted(0), strategy)
    same_error = _load(folder, same)
    other = gd.prepare_model(adapted(1), strategy)
    before = adapters(other)
    other_error = _load(folder, other)
    after = adapters(other)
    return {
        "digest": digest,
        "same_error": same_error,
        "loaded": adapters(same),
        "other_error": other_error,
        "other_untouched": all(torch.equal(before[k], after[k]) for k in before),
    }
