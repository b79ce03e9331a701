"""The fixed validation set: every validation sequence once (or a fixed sample), cut into
this rank's micro-batches, each made when it is read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gradstep_cli.data.tokenized import IGNORE_INDEX, Batch, Document, Sequences, as_sequences

__all__ = ["ValidationBatches", "validation_batches"]


class ValidationBatches(Sequence[Batch]):
    """This rank's validation micro-batches, made when read (a whole validation set is not
    held in memory): each is a group of spans, or the filler (its first batch with no
    target)."""

    def __init__(self, data: Sequences, groups: list[np.ndarray], filler: bool = False) -> None:
        self._data, self._items = data, [(g, False) for g in groups]
        if filler and groups:
            self._items.append((groups[0], True))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            out = ValidationBatches(self._data, [])
            out._items = self._items[index]
            return out
        spans, filler = self._items[index]
        batch = self._data.batch(spans)
        if filler:
            batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
        return batch


def validation_batches(
    docs: Sequence[Document] | Sequences,
    seq_len: int,
    micro_batch_size: int,
    num_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> ValidationBatches:
    """The validation micro-batches (this rank's stride of them): every sequence once, or a
    fixed sample of ``num_batches`` micro-batches.

    Document spans are full length (documents still end mid-span), records are one row
    each; all are shuffled with a fixed, seed-independent generator, so validation loss is
    comparable across runs and seeds, and a sample covers many files, not just the first
    few. Every rank gets as many batches (FSDP2's forwards all-gather): a rank short of one
    gets a copy of its first batch with no target, which scores nothing.
    """
    data = as_sequences(docs)
    spans = data.spans(seq_len, None, 1.0)
    spans = spans[np.random.default_rng(0).permutation(len(spans))]
    rows = len(spans) if num_batches is None else min(len(spans), num_batches * micro_batch_size)
    groups = [spans[i : i + micro_batch_size] for i in range(0, rows, micro_batch_size)]
    mine = groups[rank::world_size]
    return ValidationBatches(data, mine, filler=len(mine) < -(-len(groups) // world_size))
