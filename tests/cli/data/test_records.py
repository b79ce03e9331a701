"""JSONL records for --data / --val-data (gradstep_cli.data.records): each bad record named by
file and line (or skipped and counted), chat-template refusals, cuts and counts, bytes for
the toy GPT."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.records import DataError, TemplateError
from gradstep_cli.data.sources import IGNORE_INDEX, load_source

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

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def chats(n: int) -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "user", "content": f"{i}"}, CHAT["messages"][1]]} for i in range(n)
    ]


def _tokenizer(prefix: str) -> Any:
    from tests.support import hf_assets

    tokenizer = hf_assets.load_tokenizer()
    tokenizer.chat_template = prefix + hf_assets.CHAT_TEMPLATE
    return tokenizer


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


@pytest.mark.parametrize(
    ("prefix", "raised"),
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),  # S7
        ("{{ cycler.__init__.__globals__.os.system('true') }}", "SecurityError"),  # S10
        ("{% if %}", "TemplateSyntaxError"),
    ],
)
def test_a_template_at_fault_is_named_not_the_record(tmp_path: Path, prefix, raised) -> None:
    """S7: a template the sandbox stops was reported as 'fix the record' (and, with
    --skip-bad-records, skipped every record)."""
    pytest.importorskip("transformers")
    data = jsonl(tmp_path / "chat.jsonl", chats(4))
    for skip in (False, True):
        cfg = TrainConfig(data=str(data), seq_len=32, skip_bad_records=skip)
        with pytest.raises(TemplateError) as exc:
            load_source(cfg, _tokenizer(prefix))
        message = str(exc.value)
        assert "line 1: the chat template of the tokenizer in" in message, message
        assert f"is at fault, not the record: rendering raised {raised}" in message
        assert "--tokenizer PATH" in message and "fix the record" not in message


def test_a_record_the_template_refuses_names_the_record(tmp_path: Path) -> None:
    """S8 and S9 are kept: the template's own raise_exception on record 4 names line 4 (and
    --skip-bad-records skips it). A record the template fails on otherwise (here an
    UndefinedError) names the line and the tokenizer: either may be at fault."""
    pytest.importorskip("transformers")
    bad = {"messages": [{"role": "user", "content": "bad content"}, CHAT["messages"][1]]}
    data = jsonl(tmp_path / "chat.jsonl", [*chats(3), bad])
    test = "{% for m in messages %}{% if m['content'] == 'bad content' %}"
    checks = {
        "TemplateError": test + "{{ raise_exception('bad content') }}{% endif %}{% endfor %}",
        "UndefinedError": test + "{{ m.nothing.deeper }}{% endif %}{% endfor %}",
    }
    for raised, check in checks.items():
        cfg = TrainConfig(data=str(data), val_data=str(data), seq_len=32)
        tokenizer = _tokenizer(check)
        with pytest.raises(DataError) as exc:
            load_source(cfg, tokenizer)
        message = str(exc.value)
        assert "line 4: " in message and f"({raised}: " in message, message
        assert "fix the record, or pass --skip-bad-records" in message
        if raised == "TemplateError":
            assert "line 4: the chat template refused it (TemplateError: bad content)" in message
        else:
            assert f"the tokenizer in {tokenizer.name_or_path!r} failed on it" in message
        skipped = TrainConfig(data=str(data), val_data=str(data), seq_len=32, skip_bad_records=True)
        assert load_source(skipped, _tokenizer(check)).counts()["bad_skipped"] == 2
