"""What ``--data`` reads besides JSONL and text (gradstep_cli.data.reading, .specs): Parquet,
CSV, Arrow and JSON-array files, ``save_to_disk`` folders, dataset folders and Hub datasets
through the ``datasets`` library; fields named otherwise (``--prompt-field`` ...); chat
records with ``tools``; ``--chat-template-kwargs``. Bad rows are named by file and row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.data.records import DataError
from gradstep_cli.data.sources import IGNORE_INDEX, load_source

datasets = pytest.importorskip("datasets")

PAIRS = [{"prompt": f"q{i}: ", "completion": f"answer {i}"} for i in range(12)]
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.fixture(scope="module")
def tok() -> Any:
    pytest.importorskip("transformers")
    from tests.support import hf_assets

    return hf_assets.load_tokenizer()


def source(data: Any, tokenizer: Any = None, **cfg: Any) -> Any:
    return load_source(TrainConfig(data=str(data), **{"seq_len": 32, **cfg}), tokenizer)


def rows_of(src: Any) -> list[tuple[list[int], list[int]]]:
    """Every (input ids, trained labels) row of the validation side, sorted."""
    out = []
    for batch in src.validation_batches(32, 1, None, 0, 1):
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        out.append((ids, [x for x in labels if x != IGNORE_INDEX]))
    return sorted(out)


def write_all(folder: Path, records: list[dict]) -> dict[str, Path]:
    """The records as JSONL, Parquet, CSV, Arrow and a JSON array."""
    folder.mkdir(exist_ok=True)
    table = datasets.Dataset.from_list(records)
    paths = {
        "jsonl": folder / "d.jsonl",
        "parquet": folder / "d.parquet",
        "csv": folder / "d.csv",
        "json": folder / "d.json",
    }
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in records))
    table.to_parquet(str(paths["parquet"]))
    table.to_csv(str(paths["csv"]), index=False)
    paths["json"].write_text(json.dumps(records, indent=1))
    table.save_to_disk(str(folder / "saved"))
    arrow = next((folder / "saved").glob("*.arrow"))
    paths["arrow"] = folder / "d.arrow"
    paths["arrow"].write_bytes(arrow.read_bytes())
    paths["saved"] = folder / "saved"
    return paths


def test_every_local_format_trains_the_same_rows(tmp_path, tok) -> None:
    """JSONL, Parquet, CSV, Arrow, a JSON array and a save_to_disk folder of the same
    records give the same rows and targets."""
    paths = write_all(tmp_path / "d", PAIRS)
    expected = None
    for kind, path in paths.items():
        src = source(path, tok, val_data=str(path))
        assert src.counts()["val_records"] == {"prompt/completion": 12}, kind
        got = rows_of(src)
        expected = expected or got
        assert got == expected, kind


def test_a_saved_dataset_dict_and_a_dataset_folder_take_their_split(tmp_path, tok) -> None:
    train = datasets.Dataset.from_list(PAIRS)
    test = datasets.Dataset.from_list(PAIRS[:3])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    src = source(tmp_path / "dd", tok, val_data=str(tmp_path / "dd"), val_data_split="test")
    n = src.counts()
    assert n["train_records"] == {"prompt/completion": 12}
    assert n["val_records"] == {"prompt/completion": 3}
    with pytest.raises(DataError, match=r"has no split 'validation'; its splits are 'train', "):
        source(tmp_path / "dd", tok, val_data=str(tmp_path / "dd"))
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    train.to_parquet(str(repo / "train-00000.parquet"))
    test.to_parquet(str(repo / "test-00000.parquet"))
    folder = str(tmp_path / "repo")
    src = source(folder, tok, data_split="train", val_data=folder, val_data_split="test")
    assert src.counts()["val_records"] == {"prompt/completion": 3}


def test_a_hub_name_is_loaded_through_datasets_with_its_split(tmp_path, tok, monkeypatch) -> None:
    """OWNER/NAME (no such path) goes to datasets.load_dataset with --data-split; the
    dataset's fingerprint keys the store (here from a local stand-in: no network)."""
    asked = []
    table = {
        "train": datasets.Dataset.from_list(PAIRS),
        "test": datasets.Dataset.from_list(PAIRS[:2]),
    }

    def load_dataset(name: str, split: str, **kwargs: Any) -> Any:
        asked.append((name, split))
        if name != "someone/sft":
            raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")
        return table[split]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(data="someone/sft", val_data="someone/sft", val_data_split="test", seq_len=32)
    assert cfg.data == "someone/sft"  # not taken for a relative path
    n = load_source(cfg, tok).counts()
    assert n["train_records"] == {"prompt/completion": 12}
    assert n["val_records"] == {"prompt/completion": 2}
    assert asked[:2] == [("someone/sft", "train"), ("someone/sft", "test")]
    with pytest.raises(DataError, match=r"--data 'someone/missing' \(no such file or folder; "):
        load_source(TrainConfig(data="someone/missing", seq_len=32), tok)


def test_fields_named_otherwise_are_read_and_other_columns_ignored(tmp_path, tok) -> None:
    """Alpaca-like rows (instruction, output, and a formatted 'text' besides): naming the
    prompt and completion fields reads that format only."""
    rows = [{"instruction": r["prompt"], "output": r["completion"], "text": "x"} for r in PAIRS]
    path = write_all(tmp_path / "d", rows)["parquet"]
    unnamed = source(path, tok, val_data=str(path)).counts()  # the standard names: 'text'
    assert unnamed["val_records"] == {"text": 12}
    named = dict(prompt_field="instruction", completion_field="output", val_data=str(path))
    src = source(path, tok, **named)
    plain = write_all(tmp_path / "p", PAIRS)["parquet"]
    assert src.counts()["val_records"] == {"prompt/completion": 12}
    assert rows_of(src) == rows_of(source(plain, tok, val_data=str(plain)))
    with pytest.raises(DataError, match=r"row 3: no 'instruction' and 'output' field"):
        bad = write_all(tmp_path / "b", [*rows[:2], {"other": "x"}, *rows[2:]])["parquet"]
        source(bad, tok, prompt_field="instruction", completion_field="output")


def test_a_bad_row_is_named_by_file_and_row_or_skipped(tmp_path, tok) -> None:
    rows = [*PAIRS[:3], {"prompt": "q", "completion": "  "}, *PAIRS[3:]]
    path = write_all(tmp_path / "d", rows)["parquet"]
    with pytest.raises(DataError) as exc:
        source(path, tok)
    assert str(exc.value).startswith(f"--data {path} row 4: 'completion' is empty; fix the record")
    skipped = source(path, tok, skip_bad_records=True)
    assert skipped.counts()["bad_skipped"] == 1
    assert f"first: {path} row 4: 'completion' is empty" in skipped.describe()


def test_a_file_datasets_cannot_read_is_one_error_naming_it(tmp_path, tok) -> None:
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(
        DataError,
        match=r"--data '.*broken.parquet': the datasets library cannot read it \(ArrowInvalid",
    ):
        source(broken, tok)


def test_tools_and_template_kwargs_reach_the_chat_template(tmp_path, tok) -> None:
    """A record's tools and --chat-template-kwargs are rendered by the template: here a
    template that writes both into the system turn, so the tokens show them."""
    template = (
        "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='name') | join(',') }}"
        "<|im_end|>\n{% endif %}{% if think is defined %}<|im_start|>system\nthink: "
        "{{ think }}<|im_end|>\n{% endif %}"
    )
    from tests.support import hf_assets

    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = template + hf_assets.CHAT_TEMPLATE
    tools = [{"name": "search", "parameters": {"type": "object"}}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {}}]}
    turns = [{"role": "user", "content": "hi"}, call, {"role": "tool", "content": "found"}]
    record = {"messages": [*turns, CHAT["messages"][1]], "tools": tools}
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(record) + "\n")
    kwargs = json.dumps({"think": "off"})
    src = source(data, tok, val_data=str(data), chat_template_kwargs=kwargs)
    ids = src.validation_batches(512, 1, None, 0, 1)[0]["input_ids"][0].tolist()
    text = tok.decode(ids)
    assert "tools: search" in text and "think: off" in text
    bad = tmp_path / "badtools.jsonl"
    bad.write_text(json.dumps({**record, "tools": "search"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: 'tools' must be a list of objects"):
        source(bad, tok, val_data=str(bad))


def test_field_and_template_settings_are_checked_when_the_config_is_built() -> None:
    with pytest.raises(ConfigError, match=r"--chat-template-kwargs must be a JSON object"):
        TrainConfig(chat_template_kwargs="enable_thinking=false")
    with pytest.raises(ConfigError, match=r"may not set tokenize"):
        TrainConfig(chat_template_kwargs='{"tokenize": false}')
    with pytest.raises(ConfigError, match=r"the record fields must differ"):
        TrainConfig(prompt_field="q", completion_field="q")
    with pytest.raises(ConfigError, match=r"--data-split must name a field or split"):
        TrainConfig(data_split=" ")


def test_a_split_of_plain_files_is_refused(tmp_path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    with pytest.raises(DataError, match=r"--data-split 'train' picks a split of a Hub dataset"):
        source(data, data_split="train")


def test_a_tool_call_turn_may_have_no_content_and_tools_must_be_objects() -> None:
    from gradstep_cli.data.formats import Bad, Fields, check

    call = {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}
    kind, (messages, tools) = check({"messages": [{"role": "user", "content": "x"}, call]})
    assert kind == "messages" and tools is None and messages[1]["tool_calls"]
    with pytest.raises(Bad, match=r"message 1: 'content' must be a string, got NoneType"):
        check({"messages": [{"role": "user", "content": None}]})
    with pytest.raises(Bad, match=r"'tools' must be a list of objects"):
        check({"messages": [{"role": "user", "content": "x"}], "tools": ["f"]})
    fields = Fields.of(TrainConfig(messages_field="conversation"))
    assert fields.kinds == ("messages",)
    assert check({"conversation": [{"role": "user", "content": "x"}], "text": "t"}, fields)[0] == (
        "messages"
    )
