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

from typing import TYPE_CHECKING

import numpy as np
import torch

from gradstep.packing import plan_rows

if TYPE_CHECKING:
    from gradstep_cli.data.tokenized import Batch, Sequences

__all__ = ["ROW_KEYS", "WINDOW", "pack_epoch", "packed_batch", "row_kwargs"]

ROW_KEYS = ("seq_ids", "position_ids")
"""What a packed batch adds to ``input_ids`` and ``labels``: the demo GPT's forward reads them."""
WINDOW = 4096
"""Spans packed together: enough for best-fit to fill nearly every row."""


def pack_epoch(
    spans: np.ndarray, seq_len: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], float]:
    """``spans`` (in the epoch's order) packed into rows of ``seq_len`` positions (a span of
    ``n`` tokens takes ``n - 1``), best-fit decreasing within each window, the rows shuffled:
    (each row's spans, the share of the rows' positions that is padding)."""
    rows: list[np.ndarray] = []
    for at in range(0, len(spans), WINDOW):
        window = spans[at : at + WINDOW]
        lengths = (window[:, 1] - 1).tolist()
        rows += [window[row] for row in plan_rows(lengths, seq_len, order="bfd")]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    total = len(rows) * seq_len
    padding = 1.0 - int((spans[:, 1] - 1).sum()) / total if total else 0.0
    return rows, padding


def packed_batch(data: Sequences, rows: list[np.ndarray], width: int) -> Batch:
    """Rows of whole spans, ``width`` positions each: ``input_ids``, shifted ``labels``
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
