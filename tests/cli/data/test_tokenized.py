"""The training stream (gradstep_cli.data.tokenized): shifted, padded, variable-length rows in a
deterministic, seeded, resumable order, sharded by rank; records' rows and their targets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.records import Encoder
from gradstep_cli.data.sources import (
    IGNORE_INDEX,
    Document,
    TrainBatches,
    load_source,
    validation_batches,
)
from gradstep_cli.data.tokenized import Sequences

SEQ = 16


def small_docs(n: int = 6, size: int = 300) -> list[Document]:
    """Docs of distinct printable bytes (no 0 bytes, so padding is recognisable)."""
    gen = torch.Generator().manual_seed(1)
    return [
        Document(f"doc{i}.txt", bytes(torch.randint(32, 127, (size + 37 * i,), generator=gen)))
        for i in range(n)
    ]


def take(it: TrainBatches, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(it) for _ in range(n)]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["labels"], y["labels"])


def record_stream_source(tmp_path: Path) -> Any:
    """Token records of varied lengths, some cut from the left, plus text documents."""
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.data.sources import load_source
    from tests.support import hf_assets

    records = [
        {"prompt": "x = " * (i % 7 + 1), "completion": f"{i}" * (i % 5 + 1)} for i in range(30)
    ]
    records += [{"text": f"value_{i} = {i}\n" * (i + 3)} for i in range(4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = TrainConfig(data=str(data), val_data=str(data), seq_len=SEQ)
    return load_source(cfg, hf_assets.load_tokenizer())


GOOD = [{"prompt": f"q{i}: ", "completion": f"answer {i}"} for i in range(6)]


def jsonl(path: Path, lines: list[Any]) -> Path:
    """Write ``lines`` (records as JSON, str / bytes as they are), one per line."""
    raw = [
        line
        if isinstance(line, bytes)
        else (line if isinstance(line, str) else json.dumps(line)).encode()
        for line in lines
    ]
    path.write_bytes(b"\n".join(raw) + b"\n")
    return path


def source(data: Path, tokenizer: Any = None, **cfg: Any) -> Any:
    return load_source(TrainConfig(data=str(data), **{"seq_len": 32, **cfg}), tokenizer)


@pytest.fixture(scope="module")
def tok() -> Any:
    pytest.importorskip("transformers")
    from tests.support import hf_assets

    return hf_assets.load_tokenizer()


def test_batches_are_shifted_padded_and_variable_length() -> None:
    docs = small_docs()
    text = b"\n".join(d.data for d in docs)
    lengths = set()
    for batch in take(TrainBatches(docs, SEQ, 4, seed=3), 40):
        ids, labels = batch["input_ids"], batch["labels"]
        assert ids.dtype == labels.dtype == torch.long and ids.shape == labels.shape
        assert ids.shape[0] == 4 and ids.shape[1] <= SEQ
        for row in range(4):
            n = int((labels[row] != -100).sum())
            lengths.add(n)
            assert n >= 1
            assert (labels[row, n:] == -100).all() and (labels[row, :n] >= 0).all()
            assert (ids[row, n:] == 0).all() and (ids[row, :n] > 0).all()
            assert torch.equal(ids[row, 1:n], labels[row, : n - 1])  # shifted by one
            chunk = bytes(ids[row, :n].tolist()) + bytes([int(labels[row, n - 1])])
            assert chunk in text  # a contiguous piece of one document
    assert SEQ in lengths and len(lengths) > 5  # full and short sequences both occur


def test_stream_is_deterministic_and_seeded() -> None:
    docs = small_docs()
    assert_same(take(TrainBatches(docs, SEQ, 4, seed=0), 10), take(TrainBatches(docs, SEQ, 4), 10))
    other = take(TrainBatches(docs, SEQ, 4, seed=1), 10)
    assert not torch.equal(other[0]["input_ids"], next(TrainBatches(docs, SEQ, 4))["input_ids"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_shards_union_equals_single_process(world_size: int) -> None:
    docs = small_docs(n=3, size=120)  # few micro-batches per epoch: crosses epoch boundaries
    single = TrainBatches(docs, SEQ, 4, seed=5)
    per_epoch = len(single._epoch_plan(0))
    n = 4 * per_epoch + 1
    expected = take(single, n * world_size)
    ranks = [
        TrainBatches(docs, SEQ, 4, seed=5, rank=r, world_size=world_size) for r in range(world_size)
    ]
    interleaved = [next(ranks[i % world_size]) for i in range(n * world_size)]
    assert_same(interleaved, expected)


def test_state_dict_restores_the_next_micro_batch() -> None:
    docs = small_docs(n=3, size=120)
    it = TrainBatches(docs, SEQ, 4, seed=2, rank=1, world_size=2)
    take(it, 11)
    state = json.loads(json.dumps(it.state_dict()))  # must survive a JSON checkpoint
    expected = take(it, 15)
    resumed = TrainBatches(docs, SEQ, 4, seed=2, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert_same(take(resumed, 15), expected)
    with pytest.raises(ValueError, match="seed"):
        TrainBatches(docs, SEQ, 4, seed=9, rank=1, world_size=2).load_state_dict(state)


def test_epochs_reshuffle() -> None:
    it = TrainBatches(small_docs(), SEQ, 4)
    first, second = np.concatenate(it._epoch_plan(0)), np.concatenate(it._epoch_plan(1))
    assert first.shape != second.shape or not (first == second).all()


def test_validation_batches_are_fixed_and_sharded() -> None:
    docs = small_docs()
    full = validation_batches(docs, SEQ, 4, 6)
    assert len(full) == 6
    assert_same(full, validation_batches(docs, SEQ, 4, 6))
    shards = [validation_batches(docs, SEQ, 4, 6, rank=r, world_size=2) for r in range(2)]
    assert_same([shards[i % 2][i // 2] for i in range(6)], full)


@pytest.mark.parametrize("world_size", [2, 3])
def test_record_stream_shards_union_equals_single_process(tmp_path: Path, world_size: int) -> None:
    pytest.importorskip("transformers")
    src = record_stream_source(tmp_path)
    single = src.train_batches(SEQ, 3, 5, 0, 1)
    n = 3 * len(single._epoch_plan(0)) + 1  # crosses epoch boundaries
    expected = take(single, n * world_size)
    ranks = [src.train_batches(SEQ, 3, 5, r, world_size) for r in range(world_size)]
    assert_same([next(ranks[i % world_size]) for i in range(n * world_size)], expected)


def test_record_stream_resumes_bitwise_and_refuses_other_data(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    src = record_stream_source(tmp_path)
    it = src.train_batches(SEQ, 1, 4, 1, 2)  # rows of one, as with --global-batch
    take(it, 23)
    state = json.loads(json.dumps(it.state_dict()))
    expected = take(it, 30)
    resumed = src.train_batches(SEQ, 1, 4, 1, 2)
    resumed.load_state_dict(state)
    assert_same(take(resumed, 30), expected)
    other = TrainBatches(small_docs(), SEQ, 1, seed=4, rank=1, world_size=2)
    with pytest.raises(ValueError, match="data state mismatch for 'data_"):
        other.load_state_dict(state)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.binary(min_size=1, max_size=12), st.binary(min_size=1, max_size=12)),
        min_size=1,
        max_size=8,
    ),
    st.integers(2, 20),
)
def test_each_row_is_its_records_tail_and_trains_on_its_completion(
    pairs: list[tuple[bytes, bytes]], seq_len: int
) -> None:
    """For every record and --seq-len: a record is kept iff its completion fits (at least
    one prompt token stays before it); its row holds its last seq_len + 1 tokens and its
    labels are exactly the completion; the counts say how many were cut and left out."""
    records = Encoder(None).prompt_completions(
        [(p.decode("latin-1"), c.decode("latin-1")) for p, c in pairs]
    )
    data = Sequences([], records, dtype=np.uint8)
    kept = [(p.decode("latin-1").encode(), c.decode("latin-1").encode()) for p, c in pairs]
    kept = [(p, c) for p, c in kept if len(c) <= seq_len]
    spans = data.record_spans(seq_len)
    assert len(spans) == len(kept)
    cut = sum(len(p) + len(c) > seq_len + 1 for p, c in kept)
    assert data.fit(seq_len) == (cut, len(pairs) - len(kept))
    if not kept:
        return
    batch = data.batch(spans)
    for row, (p, c) in enumerate(kept):
        whole = (p + c)[-(seq_len + 1) :]
        n = len(whole) - 1
        assert batch["input_ids"][row, :n].tolist() == list(whole[:-1])
        labels = batch["labels"][row].tolist()
        assert labels[n - len(c) : n] == list(c)
        assert all(x == IGNORE_INDEX for x in labels[: n - len(c)] + labels[n:])


def test_eos_is_a_target_even_when_it_is_the_pad_token(tmp_path: Path, tok: Any) -> None:
    """Padding is masked by the labels, never by the pad id: with pad == EOS every
    completion's EOS still trains (the model learns to stop)."""
    from tests.support import hf_assets

    padded = hf_assets.load_tokenizer()
    padded.pad_token = padded.eos_token
    assert padded.pad_token_id == padded.eos_token_id
    data = jsonl(tmp_path / "d.jsonl", GOOD)
    src = source(data, padded, val_data=str(data))
    batch = src.validation_batches(32, len(GOOD), 1, 0, 1)[0]
    for labels in batch["labels"]:
        real = labels[labels != IGNORE_INDEX]
        assert int(real[-1]) == padded.eos_token_id
        assert int((labels == IGNORE_INDEX).sum()) > 0  # prompt and padding masked
