"""How a window is cut into micro-batches: a fixed number of fixed-size micro-batches
(``--accum-steps``), or an exact global batch (``--global-batch``) in micro-batches of a
chosen size, the last one shorter when the sizes do not divide.

With a global batch the data stream yields single rows, so the number of rows per rank per
step is all that defines the stream: the micro-batch size is then purely a memory setting,
and a resumed run (or one on another world size) may choose another without changing a
single update.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gradstep import parallel, windows
from gradstep_cli.config.preflight import check_global_batch, note
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.data.sources import (
    IGNORE_INDEX,
    PAD_ID,
    Batch,
    DataError,
    TextSource,
    TrainBatches,
)

__all__ = ["Layout", "layout_for", "merge_rows", "rank_batches", "windows_of"]


@dataclass(frozen=True)
class Layout:
    micro_batch_size: int
    """Rows per micro-batch (the last one of an exact window may hold fewer)."""
    micro_batches: int
    """Micro-batches per window, on each rank."""
    rows_per_rank: int | None
    """Exact rows per rank per step (global batch / world), or None: fixed micro-batches."""

    @property
    def stream_rows(self) -> int:
        """Rows per item of the data stream (TrainBatches' micro_batch_size)."""
        return 1 if self.rows_per_rank is not None else self.micro_batch_size

    @property
    def stream_items_per_window(self) -> int:
        """Stream items one window takes (what the checkpoint records as accum_steps)."""
        return self.rows_per_rank if self.rows_per_rank is not None else self.micro_batches


def layout_for(cfg: TrainConfig, world: int, micro_batch_size: int | None = None) -> Layout:
    """The window layout of ``cfg`` on ``world`` ranks (``micro_batch_size`` overrides an
    ``auto`` setting, once planned)."""
    mbs = micro_batch_size if micro_batch_size is not None else cfg.micro_batch_size
    if not isinstance(mbs, int):
        raise ConfigError("micro_batch_size 'auto' must be planned before the run is built")
    if cfg.global_batch is None:
        return Layout(mbs, cfg.accum_steps, None)
    check_global_batch(cfg.global_batch, world)
    rows = cfg.global_batch // world
    mbs = min(mbs, rows)
    return Layout(mbs, math.ceil(rows / mbs), rows)


# What pads each key of a row: padding carries no loss and is a sequence of its own (-1).
_PAD = {"input_ids": PAD_ID, "labels": IGNORE_INDEX, "seq_ids": -1, "position_ids": 0}


def merge_rows(batches: Sequence[Batch]) -> Batch:
    """One micro-batch from several, right-padded to the widest (padding carries no loss;
    packed rows are all ``--seq-len`` wide)."""
    width = max(b["input_ids"].shape[1] for b in batches)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return {key: torch.cat([pad(b[key], _PAD[key]) for b in batches]) for key in batches[0]}


def windows_of(stream: Iterator[Batch], layout: Layout) -> Iterator[list[Batch]]:
    """The training windows of ``layout`` from the data stream."""
    if layout.rows_per_rank is None:
        yield from windows(stream, layout.micro_batches)
        return
    mbs = layout.micro_batch_size
    while True:
        rows = [next(stream) for _ in range(layout.rows_per_rank)]
        yield [merge_rows(rows[i : i + mbs]) for i in range(0, len(rows), mbs)]


def rank_batches(
    cfg: TrainConfig, source: TextSource, layout: Layout, rank: int, world: int
) -> tuple[TrainBatches, list[Batch]]:
    """This rank's resumable training stream and its validation batches."""
    try:
        train_iter = source.train_batches(
            cfg.seq_len, layout.stream_rows, cfg.seed, rank, world, packing=cfg.packing
        )
    except DataError as exc:  # too few rows: say what the split took away
        raise DataError(f"{exc}{source.held}") from None
    if cfg.packing:
        note(
            f"packing: {train_iter.epoch_sequences(0):,} sequences an epoch in "
            f"{train_iter.epoch_rows(0):,} rows of --seq-len {cfg.seq_len} (padding "
            f"{train_iter.padding(0):.2%} of the positions); attention never crosses a sequence"
        )
    val = source.validation_batches(
        cfg.seq_len, layout.micro_batch_size, cfg.eval_batches, rank, world
    )
    # FSDP2 all-gathers in every forward: all ranks must evaluate as many batches.
    val = val[: parallel.min_over_ranks(len(val))]
    if not val:
        raise DataError(
            "the validation data gives some rank no batch of "
            f"{cfg.micro_batch_size} sequences of --seq-len {cfg.seq_len}; give more (--val-data,"
            " --val-fraction) or a smaller --micro-batch-size / --seq-len"
        )
    return train_iter, val
