"""The stream's epoch rule, which ``--epochs`` counts on: every row of an epoch trains
exactly once, the epoch's last micro-batch holding the rows left (it was dropped before),
and ``epoch_length`` / ``epoch_rows`` say how many micro-batches and rows an epoch has."""

from __future__ import annotations

import numpy as np
import pytest

from gradstep_cli.data.records import DataError
from gradstep_cli.data.tokenized import Sequences, TrainBatches


def records(n: int) -> Sequences:
    """``n`` one-row documents of distinct tokens: row ``i`` is ``[10 i, 10 i + 1]``."""
    return Sequences([np.array([10 * i, 10 * i + 1]) for i in range(n)], dtype=np.int64)


@pytest.mark.parametrize(("rows", "mbs", "world"), [(10, 3, 1), (10, 3, 2), (7, 2, 3), (8, 4, 2)])
def test_every_row_of_an_epoch_trains_exactly_once(rows: int, mbs: int, world: int) -> None:
    streams = [TrainBatches(records(rows), 4, mbs, seed=3, rank=r, world_size=world)
               for r in range(world)]  # fmt: skip
    length = streams[0].epoch_length(0)
    assert length == -(-rows // mbs) and streams[0].epoch_rows(0) == rows
    seen: dict[int, list[int]] = {}
    for _ in range(3 * length):  # three epochs, the ranks in lockstep
        for stream in streams:
            batch = next(stream)  # the stream's epoch is now the batch's
            ids = batch["input_ids"][:, 0].tolist()
            seen.setdefault(stream.state_dict()["epoch"], []).extend(i // 10 for i in ids)
            assert len(ids) <= mbs
    for epoch in (0, 1):  # whole epochs: every row once, none dropped
        assert sorted(seen[epoch]) == list(range(rows)), (epoch, seen[epoch])


def test_an_epochs_last_micro_batch_holds_the_rows_left() -> None:
    stream = TrainBatches(records(10), 4, 3)
    sizes = [len(next(stream)["input_ids"]) for _ in range(4)]
    assert sizes == [3, 3, 3, 1]
    assert stream.state_dict()["epoch"] == 0 and len(next(stream)["input_ids"]) == 3  # epoch 1


def test_too_little_data_is_still_refused_by_full_micro_batches() -> None:
    with pytest.raises(DataError, match="1 sequence per epoch, 0 micro-batches of 4"):
        TrainBatches(records(1), 4, 4)
    with pytest.raises(DataError, match="fewer than the 2 needed"):
        TrainBatches(records(5), 4, 4, rank=0, world_size=2)
