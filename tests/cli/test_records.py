"""JSONL records for --data / --val-data: each bad record named by file and line (or skipped
and counted), chat-template refusals, the held-out split, cuts and counts, bytes for the
demo GPT, and what the stream's rows hold for every record (a property test)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.records import Encoder
from gradstep_cli.data.sources import IGNORE_INDEX, DataError, _path_hash, _unit, load_source
from gradstep_cli.data.tokenized import Sequences

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


BAD = [
    ('{"prompt": "a", "completion": "b"', "invalid JSON (Expecting ',' delimiter"),
    ("[1, 2]", "a record must be a JSON object, got list"),
    ({"id": 7}, "no 'text', 'prompt' and 'completion', or 'messages' field (its keys: 'id')"),
    ({"prompt": "a"}, "a prompt/completion record needs both fields; 'completion' is missing"),
    ({"completion": "a"}, "a prompt/completion record needs both fields; 'prompt' is missing"),
    ({"prompt": "a", "completion": 3}, "'completion' must be a string, got int"),
    ({"prompt": "a", "completion": "  "}, "'completion' is empty"),
    ({"prompt": "", "completion": "b"}, "'prompt' is empty"),
    ({"text": None}, "'text' must be a string, got NoneType"),
    ({"text": "x", "prompt": "a", "completion": "b"}, "fields of two formats"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "message 1 has no 'content'"),
    (
        {"messages": [{"role": "user", "content": ["x"]}]},
        "message 1: 'content' must be a string, got list",
    ),
    ({"messages": ["hi"]}, "message 1 must be an object with 'role' and 'content', got str"),
    (b'{"text": "caf\xe9"}', "not UTF-8 text (byte 14)"),
]


@pytest.mark.parametrize(("line", "reason"), BAD, ids=[r[:30] for _, r in BAD])
def test_a_bad_record_is_named_by_file_and_line_or_skipped(
    tmp_path: Path, line: Any, reason: str
) -> None:
    data = jsonl(tmp_path / "d.jsonl", [GOOD[0], "", line, *GOOD[1:]])  # blank line 2
    with pytest.raises(DataError) as exc:
        source(data)
    message = str(exc.value)
    assert message.startswith(f"--data {data} line 3: {reason}"), message
    assert "--skip-bad-records" in message
    skipped = source(data, skip_bad_records=True)
    assert skipped.counts()["bad_skipped"] == 1
    assert f"1 record skipped as bad (first: {data} line 3: {reason}" in skipped.describe()
    n = skipped.counts()
    assert sum(n["train_records"].values()) + sum(n["val_records"].values()) == len(GOOD)


def test_validation_data_errors_name_val_data(tmp_path: Path) -> None:
    train = jsonl(tmp_path / "t.jsonl", GOOD)
    val = jsonl(tmp_path / "v.jsonl", [GOOD[0], {"prompt": 1, "completion": "x"}])
    with pytest.raises(DataError, match=rf"^--val-data {val} line 2: 'prompt' must be a string"):
        source(train, val_data=str(val))


def test_only_bad_records_is_an_error_even_when_skipping(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "d.jsonl", ["{", {"x": 1}])
    with pytest.raises(DataError, match=r"no usable records \(2 bad, e\.g\. .* line 1: invalid"):
        source(data, skip_bad_records=True)


def test_messages_need_a_template_that_marks_the_assistant(tmp_path: Path, tok: Any) -> None:
    from tests.support import hf_assets

    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    data = jsonl(tmp_path / "d.jsonl", [chat] * 4)
    with pytest.raises(DataError, match=r"line 1: \{\"messages\"\} records need a tokenizer"):
        source(data, None, skip_bad_records=True)  # the demo GPT reads bytes
    with pytest.raises(DataError, match="the tokenizer has no chat template"):
        source(data, hf_assets.load_tokenizer(chat=False), skip_bad_records=True)
    unmarked = hf_assets.load_tokenizer()
    unmarked.chat_template = hf_assets.CHAT_TEMPLATE.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    with pytest.raises(DataError, match=r"marks no assistant tokens \(no \{% generation %\}"):
        source(data, unmarked, skip_bad_records=True)


def test_a_conversation_the_template_refuses_is_a_bad_record(tmp_path: Path) -> None:
    from tests.support import hf_assets

    strict = hf_assets.load_tokenizer()
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}"
        + hf_assets.CHAT_TEMPLATE
    )
    turns = lambda role, i: {  # noqa: E731
        "messages": [{"role": role, "content": f"q{i}"}, {"role": "assistant", "content": "b"}]
    }
    data = jsonl(tmp_path / "d.jsonl", [turns("user", 1), turns("user", 2), turns("robot", 3)])
    with pytest.raises(DataError, match=r"line 3: the chat template refused it \(.*unknown role"):
        source(data, strict, val_data=str(data))
    n = source(data, strict, val_data=str(data), skip_bad_records=True).counts()
    assert n["bad_skipped"] == 2 and n["train_records"] == {"messages": 2}  # in both files


def test_records_with_nothing_to_train_or_too_long_are_left_out_and_counted(
    tmp_path: Path, tok: Any
) -> None:
    silent = {"messages": [{"role": "user", "content": "nobody answers"}]}
    long_prompt = {"prompt": "word " * 60, "completion": "fits"}
    long_answer = {"prompt": "q", "completion": "word " * 60}
    data = jsonl(tmp_path / "d.jsonl", [*GOOD, silent, long_prompt, long_answer])
    src = source(data, tok, val_data=str(jsonl(tmp_path / "v.jsonl", GOOD)))
    n = src.counts()
    assert (n["no_target"], n["truncated"], n["too_long"]) == (1, 1, 1)
    assert n["train_records"] == {"prompt/completion": 8}  # the silent one is gone
    line = src.describe()
    assert "1 record cut from the left to fit --seq-len 32" in line
    assert "1 record left out as too long" in line and "(raise --seq-len)" in line
    assert "1 record left out: no token to train on" in line
    rows = [row for b in src.validation_batches(32, 8, 1, 0, 1) for row in b["input_ids"]]
    assert len(rows) == len(GOOD)
    only_long = jsonl(tmp_path / "long.jsonl", [long_answer])
    with pytest.raises(DataError, match=r"--data .*: no sequence to use \(1 record too long"):
        source(only_long, tok, val_data=str(only_long))


def test_one_argument_reads_one_kind(tmp_path: Path) -> None:
    jsonl(tmp_path / "a.jsonl", GOOD)
    (tmp_path / "b.txt").write_text("some text " * 20)
    with pytest.raises(DataError, match=r"holds both JSONL files \(a\.jsonl\) and text files"):
        source(tmp_path)
    src = source(Path(f"{tmp_path}/*.jsonl"))  # a glob names the kind
    assert "records" in src.describe()


def test_formats_mix_in_one_file_and_are_counted(tmp_path: Path, tok: Any) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    records = [*GOOD, chat, chat, {"text": "x = 1\n" * 30}]
    data = jsonl(tmp_path / "d.jsonl", records)
    n = source(data, tok, val_data=str(data)).counts()
    assert n["train_records"] == {"text": 1, "prompt/completion": 6, "messages": 2}


def test_held_out_records_are_a_stable_fraction(tmp_path: Path) -> None:
    records = [{"prompt": f"p{i}", "completion": f"c{i % 50}"} for i in range(400)]
    data = jsonl(tmp_path / "d.jsonl", records)
    for fraction in (0.1, 0.25, 0.5):
        a, b = source(data, val_fraction=fraction), source(data, val_fraction=fraction)
        assert a.describe() == b.describe()
        n = a.counts()
        val, train = n["val_records"]["prompt/completion"], n["train_records"]["prompt/completion"]
        assert train + val == 400 and abs(val / 400 - fraction) < 0.06


def test_duplicate_records_land_on_one_side(tmp_path: Path) -> None:
    """The record is the split's key, not its line: no copy of a validation record trains."""
    records = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(60)]
    data = jsonl(tmp_path / "d.jsonl", [r for r in records for _ in range(3)])
    n = source(data, val_fraction=0.3).counts()
    val, train = n["val_records"]["prompt/completion"], n["train_records"]["prompt/completion"]
    assert val % 3 == 0 and train % 3 == 0 and val and train


def test_val_data_holds_nothing_out(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "d.jsonl", GOOD)
    n = source(data, val_data=str(jsonl(tmp_path / "v.jsonl", GOOD[:2]))).counts()
    assert n["train_records"] == {"prompt/completion": 6}
    assert n["val_records"] == {"prompt/completion": 2}


@given(st.text(min_size=1, max_size=40))
def test_a_tenth_held_out_is_the_files_it_always_was(name: str) -> None:
    """--val-fraction 0.1 keeps the old rule (path hash mod 10 == 0): the default corpus's
    split, and so every earlier run's data, is unchanged."""
    assert (_unit(name) < 0.1) == (_path_hash(name) % 10 == 0)
    assert 0.0 <= _unit(name) < 1.0


def test_bytes_records_for_the_demo_gpt(tmp_path: Path) -> None:
    """Without a tokenizer: UTF-8 bytes, no EOS (a byte vocabulary has none), the
    completion's bytes are the only targets."""
    data = jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "completion": "cd"}, {"text": "xyz"}])
    src = source(data, val_data=str(data), seq_len=8)
    rows = []
    for batch in src.validation_batches(8, 1, 10, 0, 1):
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        rows.append((bytes(ids), [chr(x) if x != IGNORE_INDEX else None for x in labels]))
    assert sorted(rows) == sorted([(b"abc", [None, "c", "d"]), (b"xy", ["y", "z"])])


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
