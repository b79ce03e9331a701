"""gradstep_cli.plan.rows: the rows a plan is made for, and the probe's batches of them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.plan.rows import PACKED_SPANS, probe_batches, rows_of


class Tokens(list):
    """``Sequences``: its length in tokens, and their mask."""

    def __init__(self, trainable):
        super().__init__(range(10 if trainable is None else len(trainable)))
        self.trainable = trainable


class Source:
    """The data stage's ``TextSource`` as the planner reads it: one epoch's row lengths,
    and the training tokens' mask (None: text, every token trains)."""

    def __init__(self, lengths, trainable=None):
        self._lengths = np.asarray(lengths)
        self.train = SimpleNamespace(data=Tokens(trainable))

    def lengths(self, seq_len, seed=0):
        return self._lengths


def test_unpacked_rows_are_the_datas_lengths_and_packed_ones_are_all_seq_len():
    cfg = TrainConfig(seq_len=64)
    rows = rows_of(cfg, Source([5, 64, 5, 30, 64, 64]))
    assert rows.width == 64 and not rows.packed
    assert rows.lengths.tolist() == [5, 30, 64] and rows.counts.tolist() == [2, 1, 3]
    assert rows.distribution() == ([5, 30, 64], [2, 1, 3])
    packed = rows_of(dataclasses.replace(cfg, packing=True), Source([5, 30]))
    assert packed.width == 64 and packed.packed
    assert packed.distribution() == (None, None)  # every row --seq-len long


def test_the_share_of_tokens_that_train_comes_from_the_datas_mask():
    cfg = TrainConfig(seq_len=64)
    assert rows_of(cfg, Source([10, 20])).trained == 1.0  # text
    mask = np.array([False, False, False, True] * 5)  # prompts of 3, completions of 1
    assert rows_of(cfg, Source([10, 20], mask)).trained == 0.25


def test_the_probes_packed_rows_hold_several_sequences_with_restarting_positions():
    cfg = TrainConfig(seq_len=12, packing=True)
    batch, _, _ = probe_batches(cfg, torch.device("cpu"), vocab=50, packed=True)
    b = batch(2, 12)
    assert set(b) == {"input_ids", "labels", "seq_ids", "position_ids"}
    assert b["seq_ids"][0].tolist() == [0] * 4 + [1] * 4 + [2] * 4 and PACKED_SPANS == 3
    assert b["position_ids"][1].tolist() == list(range(4)) * 3
    plain, _, _ = probe_batches(cfg, torch.device("cpu"), vocab=50, packed=False)
    assert set(plain(2, 12)) == {"input_ids", "labels"}
