"""The token store (gradstep_cli.data.store, .prepare): the data tokenized once into files on
disk, the same rows and digest as the data in memory, reused only while nothing that
changes the tokens changed, rows read a batch at a time."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.scan import _held_out, held_mask
from gradstep_cli.data.sources import load_source
from gradstep_cli.data.store import StoreFile, cache_root
from gradstep_cli.data.tokenized import Sequences

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.fixture(scope="module")
def tok() -> Any:
    pytest.importorskip("transformers")
    from tests.support import hf_assets

    return hf_assets.load_tokenizer()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GRADSTEP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokens"


def mixed(path: Path) -> Path:
    records = [{"prompt": f"q{i}: " * (i % 4 + 1), "completion": f"a{i} b"} for i in range(40)]
    records += [CHAT, {"text": "x = 1\n" * 300}, {"text": "short text"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def rows(source: Any, n: int = 12) -> list[dict[str, torch.Tensor]]:
    stream = source.train_batches(32, 3, 7, 0, 1)
    return [next(stream) for _ in range(n)]


def test_a_second_load_reuses_the_store_with_the_same_rows(tmp_path, cache, tok) -> None:
    data = mixed(tmp_path / "d.jsonl")
    cfg = TrainConfig(data=str(data), seq_len=32)
    first, second = load_source(cfg, tok), load_source(cfg, tok)
    assert not first.prepared.reused and second.prepared.reused
    assert first.prepared.store == second.prepared.store
    assert Path(first.prepared.store).parent == cache
    assert first.describe() == second.describe() and first.counts() == second.counts()
    assert first.train.data.digest() == second.train.data.digest()
    for a, b in zip(rows(first), rows(second), strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_the_store_holds_what_memory_would(tmp_path, cache, tok) -> None:
    """The digest a resume checks is the one the in-memory buffer of the same tokens,
    masks and boundaries has: checkpoints of earlier versions resume on a store."""
    source = load_source(TrainConfig(data=str(mixed(tmp_path / "d.jsonl")), seq_len=32), tok)
    data = source.train.data
    assert isinstance(data.ids, StoreFile)  # not in memory
    ids = data.ids.read(0, len(data))
    mask = data.trainable.read(0, len(data))
    memory = Sequences.__new__(Sequences)
    memory.ids, memory.trainable = ids, mask
    memory.doc_offsets, memory.records, memory._digest = data.doc_offsets, data.records, None
    assert memory.digest() == data.digest()
    spans = data.spans(32, np.random.default_rng(0), 0.75)
    memory._tokens = len(ids)
    a, b = memory.batch(spans), data.batch(spans)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_text_files_in_the_store_are_the_bytes_and_the_old_digest(tmp_path, cache) -> None:
    from gradstep_cli.data.sources import TrainBatches, load_corpus

    folder = tmp_path / "txt"
    folder.mkdir()
    for i in range(12):
        (folder / f"f{i}.txt").write_text(f"line {i}: " + "abc def\n" * (50 + 30 * i))
    source = load_source(TrainConfig(data=str(folder), seq_len=16))
    old = load_corpus(str(folder))  # the in-memory path the stream had before the store
    stream, before = source.train_batches(16, 4, 3, 0, 1), TrainBatches(old.train, 16, 4, 3)
    assert stream.state_dict() == before.state_dict()  # digest, token count: a resume matches
    for _ in range(20):
        a, b = next(stream), next(before)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_what_changes_the_tokens_changes_the_store(tmp_path, cache, tok) -> None:
    data = mixed(tmp_path / "d.jsonl")
    base = dict(data=str(data), seq_len=32)
    first = load_source(TrainConfig(**base), tok).prepared.store
    seen = {first}
    changes = [
        (TrainConfig(**base, val_fraction=0.2), tok),
        (TrainConfig(**base, skip_bad_records=True), tok),
        (TrainConfig(**base, skip_bad_records=True, prompt_field="prompt"), tok),
        (TrainConfig(**base, chat_template_kwargs='{"x": 1}'), tok),
        (TrainConfig(**base, val_data=str(data)), tok),
    ]
    other = type(tok).from_pretrained(tok.name_or_path)
    other.chat_template = other.chat_template + "{# another template #}"
    changes.append((TrainConfig(**base), other))
    for cfg, tokenizer in changes:
        prepared = load_source(cfg, tokenizer).prepared
        assert not prepared.reused and prepared.store not in seen, cfg
        seen.add(prepared.store)
    with data.open("a") as f:  # the file changes: a new store, never the stale one
        f.write(json.dumps({"prompt": "new", "completion": "record"}) + "\n")
    again = load_source(TrainConfig(**base), tok)
    assert not again.prepared.reused and again.prepared.store != first
    assert (
        sum(again.counts()["train_records"].values()) + sum(again.counts()["val_records"].values())
        == 44
    )


def test_a_damaged_or_half_written_store_is_built_again(tmp_path, cache, tok) -> None:
    cfg = TrainConfig(data=str(mixed(tmp_path / "d.jsonl")), seq_len=32)
    store = Path(load_source(cfg, tok).prepared.store)
    expected = load_source(cfg, tok).train.data.digest()
    with (store / "train.ids").open("r+b") as f:
        f.truncate(8)
    rebuilt = load_source(cfg, tok)
    assert not rebuilt.prepared.reused and rebuilt.train.data.digest() == expected
    (store / "meta.json").unlink()  # a build killed before it published
    assert not load_source(cfg, tok).prepared.reused
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_failed_build_leaves_nothing(tmp_path, cache) -> None:
    from gradstep_cli.data.records import DataError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": 3}\n')
    with pytest.raises(DataError, match="line 2"):
        load_source(TrainConfig(data=str(bad), seq_len=32))
    assert not cache.exists() or not list(cache.iterdir())


def test_the_cache_moves_with_gradstep_cache_and_falls_back_when_unwritable(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("GRADSTEP_CACHE", str(tmp_path / "elsewhere"))
    assert cache_root() == tmp_path / "elsewhere" / "tokens"
    monkeypatch.delenv("GRADSTEP_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "gradstep" / "tokens"
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("GRADSTEP_CACHE", str(blocked))
    data = tmp_path / "t.txt"
    data.write_text("some text\n" * 200)
    source = load_source(TrainConfig(data=str(data), seq_len=16))
    assert "the token store is in a temporary folder, not kept" in capsys.readouterr().err
    assert os.path.isdir(source.prepared.store) and len(source.train.data) > 0


@given(
    n=st.integers(2, 300),
    copies=st.integers(1, 3),
    fraction=st.floats(1e-4, 0.9999),
    prefix=st.text(max_size=6),
)
@example(n=40, copies=2, fraction=0.9999, prefix="")  # every key below: the last one trains
@example(n=7, copies=3, fraction=1e-4, prefix="x")  # none below: the smallest hash is held
def test_the_vectorised_split_is_the_rule(n: int, copies: int, fraction: float, prefix: str):
    """The data stage splits records by :func:`held_mask` over their hashes: exactly
    ``_held_out`` (docs/guide/cli.md's rule, tested in test_sources.py) of their keys."""
    from gradstep_cli.data.files import path_hash

    keys = [f"{prefix}record {i}" for i in range(n) for _ in range(copies)]
    hashes = np.array([path_hash(k) for k in keys], dtype=np.uint64)
    assert held_mask(hashes, fraction).tolist() == _held_out(keys, fraction)
