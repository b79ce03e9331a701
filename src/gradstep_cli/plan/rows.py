"""The rows a plan is made for: the data's row lengths as the planner sees them
(:class:`Rows`), and the probe's micro-batches of such rows (:func:`probe_batches`).

Unpacked, a micro-batch is padded to its longest row, so memory is planned at the data's
longest row and the step's work at the longest of ``mbs`` random rows (the speed model,
:mod:`gradstep.memory.speed`); the lengths come from the data stage (``TextSource.lengths``,
one epoch's rows). Packed (``--packing``), every row is ``--seq-len`` positions of whole
sequences with a block-causal mask: one shape, so the probe runs packed rows of exactly that
width and needs no sweep of other lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradstep_cli.config.settings import TrainConfig

__all__ = ["PACKED_SPANS", "Rows", "probe_batches", "rows_of"]

PACKED_SPANS = 3
"""Sequences in each of the probe's packed rows (any number > 1 makes the mask block-causal;
its memory does not depend on how many)."""


@dataclass
class Rows:
    """The run's training rows as the planner sees them."""

    width: int
    """The longest row: what memory is planned for (packed: ``--seq-len``)."""
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Distinct row lengths, ascending (empty: packed, or not known)."""
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """How many rows of one epoch have each length."""
    packed: bool = False
    trained: float = 1.0
    """The share of the rows' tokens that are targets (a prompt's are not)."""
    source: Any = None
    """Held while probing, so that the probe's baseline holds the data as the run will."""

    def distribution(self) -> tuple[list[int] | None, list[int] | None]:
        """(lengths, counts) for the speed model; (None, None): every row ``width`` long."""
        if self.packed or not len(self.lengths):
            return None, None
        return self.lengths.tolist(), self.counts.tolist()


def rows_of(cfg: TrainConfig, source: Any) -> Rows:
    """The rows ``cfg`` trains on, from the data stage's ``source`` (None: rows of
    ``--seq-len``, lengths unknown)."""
    trained = _trained(source)
    if cfg.packing:
        return Rows(cfg.seq_len, packed=True, trained=trained, source=source)
    if source is None or not hasattr(source, "lengths"):
        return Rows(cfg.seq_len, source=source)
    lengths, counts = np.unique(source.lengths(cfg.seq_len, cfg.seed), return_counts=True)
    if not len(lengths):
        return Rows(cfg.seq_len, source=source)
    return Rows(int(lengths[-1]), lengths, counts, trained=trained, source=source)


TRAINED_SAMPLE = 1 << 22
"""Tokens of the training data read to find the share that trains (a prefix)."""


def _trained(source: Any) -> float:
    """The share of the training tokens that are targets: 1 for text (every token), less
    for prompt/completion and chat records (the data's mask, read over a prefix)."""
    data = getattr(getattr(source, "train", None), "data", None)
    mask = getattr(data, "trainable", None)
    if mask is None:
        return 1.0
    count = min(len(data), TRAINED_SAMPLE)
    part = mask.read(0, count) if hasattr(mask, "read") else mask[:count]
    return float(np.mean(part)) if count else 1.0


def probe_batches(
    cfg: TrainConfig, device: torch.device, vocab: int, packed: bool
) -> tuple[Callable[[int, int], dict], Callable, Any]:
    """((rows, width) -> a micro-batch of random ids, the run's loss, its count). Packed:
    rows of :data:`PACKED_SPANS` sequences with the keys the data stage's packed rows have
    (``seq_ids``, ``position_ids``), so the probe's step pays for the block-causal mask."""
    from gradstep_cli.run.components import loss_for

    gen = torch.Generator().manual_seed(0)

    def batch(rows: int, width: int) -> dict:
        ids = torch.randint(0, vocab, (rows, width), generator=gen)
        out = {"input_ids": ids, "labels": ids.roll(-1, 1)}
        if packed:
            out.update(_packed_keys(rows, width))
        return {k: v.to(device) for k, v in out.items()}

    loss_fn, count = loss_for(cfg, device)
    return batch, loss_fn, count


def _packed_keys(rows: int, width: int) -> dict[str, torch.Tensor]:
    """``seq_ids`` and ``position_ids`` of rows cut into :data:`PACKED_SPANS` sequences."""
    cuts = [width * k // PACKED_SPANS for k in range(PACKED_SPANS + 1)]
    spans = list(zip(cuts[:-1], cuts[1:], strict=True))
    seq = torch.cat([torch.full((b - a,), k) for k, (a, b) in enumerate(spans)])
    pos = torch.cat([torch.arange(b - a) for a, b in spans])
    return {"seq_ids": seq.expand(rows, -1).clone(), "position_ids": pos.expand(rows, -1).clone()}
