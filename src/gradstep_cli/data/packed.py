"""``--packing``: an epoch's spans packed into rows of ``--seq-len`` positions.

Each span (a document's chunk, a record) stays whole and alone: the rows carry ``seq_ids``
(the span of each position in its row; padding is a span of its own) and ``position_ids``
(restarting at each span), from which the model's attention is made block-causal
(:mod:`gradstep.packing`). Labels are the spans' own shifted targets, so no position of one
span predicts a token of the next, and a row's items are the sum of its spans' items: the
step's normalisation is unchanged.

Rows are made by best-fit decreasing (:func:`gradstep.packing.plan_rows`) over windows of
:data:`WINDOW` spans in the epoch's shuffled order (padding stays a fraction of a percent,
an epoch of millions of spans packs in seconds), then shuffled with the epoch's generator:
the whole plan is a function of (seed, epoch), so a packed run resumes bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gradstep.packing import plan_rows

Batch = dict[str, torch.Tensor]

__all__ = ["ROW_KEYS", "WINDOW", "PackedPlan", "pack_epoch", "packed_batch", "row_kwargs"]

ROW_KEYS = ("seq_ids", "position_ids")
"""What a packed batch adds to ``input_ids`` and ``labels``: the demo GPT's forward reads them."""
WINDOW = 4096
"""Spans packed together: enough for best-fit to fill nearly every row."""


class PackedPlan(Sequence[list[np.ndarray]]):
    """An epoch's packed micro-batches, held as two arrays: the spans in row order and
    where each row starts (an epoch of millions of rows is not millions of objects).
    Item ``i`` is micro-batch ``i``: the spans of each of its rows."""

    def __init__(self, spans: np.ndarray, starts: np.ndarray, rows_per_batch: int) -> None:
        self.spans, self.starts, self.rows_per_batch = spans, starts, rows_per_batch

    @property
    def rows(self) -> int:
        return len(self.starts) - 1

    def __len__(self) -> int:
        return -(-self.rows // self.rows_per_batch)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        first = (index % len(self)) * self.rows_per_batch
        rows = range(first, min(first + self.rows_per_batch, self.rows))
        return [self.spans[self.starts[r] : self.starts[r + 1]] for r in rows]


def pack_epoch(
    spans: np.ndarray, seq_len: int, rng: np.random.Generator, rows_per_batch: int = 1
) -> tuple[PackedPlan, float]:
    """``spans`` (in the epoch's order) packed into rows of ``seq_len`` positions (a span of
    ``n`` tokens takes ``n - 1``), best-fit decreasing within each window, the rows shuffled
    and cut into micro-batches of ``rows_per_batch`` rows: (the plan, the share of the rows'
    positions that is padding)."""
    order: list[np.ndarray] = []  # span indices, row after row
    sizes: list[int] = []  # spans per row
    for at in range(0, len(spans), WINDOW):
        lengths = (spans[at : at + WINDOW, 1] - 1).tolist()
        for row in plan_rows(lengths, seq_len, order="bfd"):
            order.append(np.asarray(row, dtype=np.int64) + at)
            sizes.append(len(row))
    size = np.asarray(sizes, dtype=np.int64)
    flat = np.concatenate(order) if order else np.empty(0, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(size)))
    shuffled = rng.permutation(len(size))
    new_size = size[shuffled]
    new_starts = np.concatenate(([0], np.cumsum(new_size)))
    # Each position of the shuffled order reads its row's old start plus its offset in it.
    offset = np.arange(len(flat)) - np.repeat(new_starts[:-1], new_size)
    flat = flat[np.repeat(starts[:-1][shuffled], new_size) + offset]
    total = len(size) * seq_len
    padding = 1.0 - int((spans[:, 1] - 1).sum()) / total if total else 0.0
    return PackedPlan(spans[flat], new_starts, rows_per_batch), padding


def packed_batch(data: Any, rows: list[np.ndarray], width: int) -> Batch:
    """Rows of whole spans of ``data`` (a :class:`~.tokenized.Sequences`: its ``row``), ``width``
    positions each: ``input_ids``, shifted ``labels``
    (-100 on padding), ``seq_ids`` and ``position_ids`` (restarting per span)."""
    shape = (len(rows), width)
    input_ids = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    seq_ids = torch.zeros(shape, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    for r, spans in enumerate(rows):
        at = 0
        for k, (start, n) in enumerate(spans.tolist()):
            ids, targets = data.row(start, n)
            m = n - 1
            input_ids[r, at : at + m] = torch.from_numpy(ids)
            labels[r, at : at + m] = torch.from_numpy(targets)
            seq_ids[r, at : at + m] = k
            positions[r, at : at + m] = torch.arange(m)
            at += m
        seq_ids[r, at:] = len(spans)  # the padding: a span of its own
        positions[r, at:] = torch.arange(width - at)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "seq_ids": seq_ids,
        "position_ids": positions,
    }


def row_kwargs(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """The demo GPT's keyword arguments of a packed ``batch`` (none for an unpacked one)."""
    return {k: batch[k].to(device, non_blocking=True) for k in ROW_KEYS if k in batch}
