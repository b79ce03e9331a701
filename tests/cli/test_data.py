"""Data pipeline: corpus split, padding and shifting, variable lengths, sharding, resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gradstep_cli.data.sources import (
    DataError,
    Document,
    TrainBatches,
    collate,
    default_corpus_files,
    load_corpus,
    validation_batches,
)

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


def test_default_corpus_is_deterministic_and_split_by_file() -> None:
    first, second = load_corpus(), load_corpus()
    assert [d.name for d in first.train] == [d.name for d in second.train]
    assert [d.name for d in first.val] == [d.name for d in second.val]
    train_names, val_names = {d.name for d in first.train}, {d.name for d in first.val}
    assert train_names and val_names and not train_names & val_names
    total = sum(len(d.data) for d in first.train + first.val)
    assert 1_000_000 < total <= 3_000_000
    _, files = default_corpus_files()
    assert all("/test/" not in f.as_posix() and "site-packages" not in str(f) for f in files)


def test_collate_pads_and_shifts() -> None:
    batch = collate([b"abcde", b"xy", b"pqrs"])
    assert batch["input_ids"].tolist() == [
        [97, 98, 99, 100],
        [120, 0, 0, 0],
        [112, 113, 114, 0],
    ]
    assert batch["labels"].tolist() == [
        [98, 99, 100, 101],
        [121, -100, -100, -100],
        [113, 114, 115, -100],
    ]


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
    first, second = it._epoch_plan(0).copy(), it._epoch_plan(1)
    assert first.shape != second.shape or not (first == second).all()


def test_validation_batches_are_fixed_and_sharded() -> None:
    docs = small_docs()
    full = validation_batches(docs, SEQ, 4, 6)
    assert len(full) == 6
    assert_same(full, validation_batches(docs, SEQ, 4, 6))
    shards = [validation_batches(docs, SEQ, 4, 6, rank=r, world_size=2) for r in range(2)]
    assert_same([shards[i % 2][i // 2] for i in range(6)], full)


def test_user_data_file_folder_and_glob(tmp_path: Path) -> None:
    for i in range(12):
        sub = tmp_path / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i}.txt").write_text(f"hello {i} " * 50)
    (tmp_path / "d0" / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)  # binary: skipped
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("secret")  # hidden: skipped

    folder = load_corpus(str(tmp_path))
    names = [d.name for d in folder.train + folder.val]
    assert len(names) == 12 and "d0/blob.bin" not in names
    assert folder.val and not {d.name for d in folder.train} & {d.name for d in folder.val}

    globbed = load_corpus(str(tmp_path / "d1" / "*.txt"))
    assert len(globbed.train) + len(globbed.val) == 4 and globbed.val

    single = load_corpus(str(tmp_path / "d2" / "f2.txt"))
    data = (tmp_path / "d2" / "f2.txt").read_bytes()
    assert single.train[0].data + single.val[0].data == data  # tail is validation

    with pytest.raises(DataError, match="no such"):
        load_corpus(str(tmp_path / "missing"))
    with pytest.raises(DataError, match="no files found"):
        load_corpus(str(tmp_path / "*.nothing"))


def test_refused_files_say_why(tmp_path: Path) -> None:
    """Robustness O16: text followed by NUL bytes was refused as "no non-empty UTF-8 text"
    without saying the file is binary. Each refused kind of file is named with its reason."""
    nul_later = tmp_path / "nulllater.txt"
    nul_later.write_bytes(b"print('hello')\n" * 800 + b"\x00" * 50_000)  # NUL after 12 KB
    with pytest.raises(DataError) as exc:
        load_corpus(str(nul_later))
    assert "'nulllater.txt' is binary (NUL bytes)" in str(exc.value), exc.value
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.bin").write_bytes(b"\x00\x01")
    (mixed / "b.bin").write_bytes(b"abc\x00")
    (mixed / "empty.txt").write_bytes(b"")
    (mixed / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError) as exc:
        load_corpus(str(mixed))
    message = str(exc.value)
    assert message.startswith(f"--data {str(mixed)!r}: no non-empty UTF-8 text files found")
    for part in ("2 files are binary (NUL bytes), e.g. 'a.bin'", "'empty.txt' is empty",
                 "'latin1.txt' is not UTF-8 text"):  # fmt: skip
        assert part in message, message
    (mixed / "ok.txt").write_text("text " * 100)  # one usable file: the others are skipped
    corpus = load_corpus(str(mixed))
    assert [d.name for d in corpus.train + corpus.val] == ["ok.txt", "ok.txt#val"]


# ------------------------------------------------------- the stream over records and tokens


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


def test_record_rows_merge_into_exact_global_batches(tmp_path: Path) -> None:
    """--global-batch: single rows merged into micro-batches keep every row's tokens and
    targets (right padding, -100 labels) whatever the micro-batch size."""
    pytest.importorskip("transformers")
    from gradstep_cli.data.batching import merge_rows

    src = record_stream_source(tmp_path)
    rows = take(src.train_batches(SEQ, 1, 0, 0, 1), 7)
    merged = merge_rows(rows)
    assert merged["input_ids"].shape[0] == 7
    for i, row in enumerate(rows):
        n = row["input_ids"].shape[1]
        assert torch.equal(merged["input_ids"][i, :n], row["input_ids"][0])
        assert torch.equal(merged["labels"][i, :n], row["labels"][0])
        assert (merged["labels"][i, n:] == -100).all()
    assert sum(int((r["labels"] != -100).sum()) for r in rows) == int(
        (merged["labels"] != -100).sum()
    )
