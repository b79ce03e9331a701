"""The data stage end to end (issue 30 §2): a run tokenizes its data once into the token
store and says so, a second run and a resume reuse it and say so, the time to the first
step is printed and in summary.json, the share of --data held out for validation is a
warning with its count unless asked for, a budgeted plan holds the data stage's peak, and
records of other formats (Parquet) train an HF model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradstep_cli.cli import main

GPT = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "0", "--eval-every", "0",
]  # fmt: skip
RUN = ["--eval-batches", "1", "--sample-tokens", "0", "--warmup", "0", "--eval-every", "0"]
PAIRS = [{"prompt": f"q{i}: ", "completion": f"answer {i}"} for i in range(24)]


def train(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["train", *argv]) == 0
    return capsys.readouterr().err


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GRADSTEP_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "txt"
    folder.mkdir()
    for i in range(12):
        (folder / f"f{i}.txt").write_text(f"file {i}\n" + "some text to train on\n" * 40)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.support import hf_assets

    return hf_assets.model_dir(tmp_path_factory.mktemp("hf") / "llama", "llama", seed=0)


def test_a_run_tokenizes_once_then_a_second_run_and_a_resume_reuse(tmp_path, corpus, capsys):
    first = tmp_path / "first"
    run = [*GPT, "--data", str(corpus), "--save-every", "2"]
    err = train(capsys, *run, "--max-steps", "4", "--stop-after", "2", "--out", str(first))
    assert err.count("data: tokenized ") == 1 and "data: reused" not in err
    assert "first step after " in err
    summary = json.loads((first / "summary.json").read_text())
    assert 0 < summary["data_prep_s"] <= summary["time_to_first_step_s"]
    err = train(capsys, *run, "--max-steps", "2", "--out", str(tmp_path / "second"))
    assert "data: reused the token store" in err and "data: tokenized" not in err
    err = train(capsys, "--out", str(first), "--resume")
    assert "data: reused the token store" in err and "resumed" in err.lower()
    uninterrupted = tmp_path / "whole"
    train(capsys, *run, "--max-steps", "4", "--out", str(uninterrupted))
    resumed = [json.loads(x)["loss"] for x in (first / "metrics.jsonl").read_text().splitlines()]
    whole = [
        json.loads(x)["loss"] for x in (uninterrupted / "metrics.jsonl").read_text().splitlines()
    ]
    assert resumed == whole  # the reused store streams the very same rows


def test_training_data_held_out_for_validation_is_a_warning_unless_asked(
    tmp_path, corpus, capsys
) -> None:
    run = [*GPT, "--data", str(corpus), "--max-steps", "1"]
    err = train(capsys, *run, "--out", str(tmp_path / "a"))
    warning = [line for line in err.splitlines() if line.startswith("warning: --val-fraction")]
    assert len(warning) == 1, err
    assert re.search(r"holds \d+ of the 12 files of --data out for validation", warning[0])
    assert "--val-data PATH" in warning[0]
    err = train(capsys, *run, "--val-fraction", "0.1", "--out", str(tmp_path / "b"))
    assert "warning: --val-fraction" not in err  # asked for: said in the data line only
    err = train(capsys, *run, "--val-data", str(corpus / "f0.txt"), "--out", str(tmp_path / "c"))
    assert "warning: --val-fraction" not in err and "12 train docs" in err, err


def test_a_budgeted_plan_holds_the_data_stages_peak(tmp_path, llama, capsys, monkeypatch):
    monkeypatch.setenv("GRADSTEP_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    out = tmp_path / "auto"
    auto = ["--micro-batch-size", "auto", "--global-batch", "4", "--memory-budget", "3GiB"]
    argv = ["--model", f"hf:{llama}", "--data", str(data), "--seq-len", "32", *auto]
    err = train(capsys, *argv, *RUN, "--max-steps", "1", "--out", str(out))
    assert err.count("data: tokenized ") == 1  # the planner read the data stage's tokens
    plan = json.loads((out / "plan.json").read_text())
    assert 0 < plan["data_peak_bytes"] <= plan["predicted_peak_bytes"]


def test_parquet_records_fine_tune_an_hf_model(tmp_path, llama, capsys, monkeypatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("GRADSTEP_CACHE", str(tmp_path / "cache"))
    rows = [
        {"question": r["prompt"], "answer": r["completion"], "id": i} for i, r in enumerate(PAIRS)
    ]
    data = tmp_path / "sft.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    fields = ["--prompt-field", "question", "--completion-field", "answer"]
    argv: list[Any] = ["--model", f"hf:{llama}", "--data", str(data), *fields, "--seq-len", "32"]
    err = train(capsys, *argv, *RUN, "--max-steps", "2", "--out", str(tmp_path / "run"))
    assert "train records (" in err and "prompt/completion" in err, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2


def write_format(folder: Path, kind: str, records: list[dict]) -> Path:
    """``records`` as ``kind``: JSONL, a JSON array, Parquet, CSV, Arrow or a save_to_disk
    folder (the forms ``datasets.load_dataset`` reads locally)."""
    datasets = pytest.importorskip("datasets")
    folder.mkdir(parents=True, exist_ok=True)
    table, path = datasets.Dataset.from_list(records), folder / f"d.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "json":
        path.write_text(json.dumps(records, indent=1))
    elif kind == "parquet":
        table.to_parquet(str(path))
    elif kind == "csv":
        table.to_csv(str(path), index=False)
    else:
        table.save_to_disk(str(folder / "saved"))
        if kind == "saved":
            return folder / "saved"
        path.write_bytes(next((folder / "saved").glob("*.arrow")).read_bytes())
    return path


def hf_train(capsys: Any, llama: Path, out: Path, *argv: str) -> str:
    """A one-step run of the tiny Llama into ``out``; what it printed."""
    model = ["--model", f"hf:{llama}", "--seq-len", "32", *RUN, "--max-steps", "1"]
    return train(capsys, *model, *argv, "--out", str(out))


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "arrow", "saved"])
def test_every_local_format_trains_through_the_cli(tmp_path, llama, capsys, monkeypatch, kind):
    """Each form ``datasets.load_dataset`` reads locally is --data as it is; the share
    --val-fraction holds out is a warning with its count."""
    monkeypatch.setenv("GRADSTEP_CACHE", str(tmp_path / "cache"))
    data = write_format(tmp_path / "d", kind, PAIRS)
    err = hf_train(capsys, llama, tmp_path / "run", "--data", str(data))
    said = re.search(r"warning: --val-fraction 0.1 holds (\d+) of the 24 records of --data", err)
    assert said, err
    line = next(x for x in err.splitlines() if " train records (" in x)
    assert f"{24 - int(said[1])} train records ({24 - int(said[1])} prompt/completion" in line
    assert f"{said[1]} val records ({said[1]} prompt/completion" in line, line
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 1


def test_data_split_picks_a_split_of_a_saved_dataset_or_a_dataset_folder(
    tmp_path, llama, capsys, monkeypatch
) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("GRADSTEP_CACHE", str(tmp_path / "cache"))
    train_rows, test_rows = datasets.Dataset.from_list(PAIRS), datasets.Dataset.from_list(PAIRS[:5])
    saved = tmp_path / "dd"
    datasets.DatasetDict({"train": train_rows, "test": test_rows}).save_to_disk(str(saved))
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    train_rows.to_parquet(str(repo / "data" / "train-00000-of-00001.parquet"))
    test_rows.to_parquet(str(repo / "data" / "test-00000-of-00001.parquet"))
    for data in (saved, repo):
        splits = ["--data-split", "train", "--val-data", str(data), "--val-data-split", "test"]
        err = hf_train(capsys, llama, tmp_path / data.name, "--data", str(data), *splits)
        assert "24 train records (24 prompt/completion" in err, err
        assert "5 val records (5 prompt/completion" in err and "warning:" not in err
    err = main(["train", "--model", f"hf:{llama}", "--data", str(saved), "--val-data", str(saved),
                "--val-data-split", "dev", "--out", str(tmp_path / "bad")])  # fmt: skip
    said = capsys.readouterr().err
    assert err == 2 and "has no split 'dev'; its splits are 'train', 'test'" in said, said


def test_text_field_names_the_column_of_text_records(tmp_path, llama, capsys, monkeypatch):
    """A CSV whose text is in 'body' (besides a 'label'): --text-field reads it."""
    monkeypatch.setenv("GRADSTEP_CACHE", str(tmp_path / "cache"))
    rows = [{"body": f"document {i}: " + "words to learn from " * 8, "label": i} for i in range(20)]
    data = write_format(tmp_path / "d", "csv", rows)
    err = hf_train(capsys, llama, tmp_path / "run", "--data", str(data), "--text-field", "body")
    line = next(x for x in err.splitlines() if " train records (" in x)
    assert re.search(r"\d+ train records \(\d+ text;", line) and "val records" in line, line
    err = main(["train", "--model", f"hf:{llama}", "--data", str(data), "--out",
                str(tmp_path / "bad")])  # fmt: skip
    said = capsys.readouterr().err
    assert err == 2 and "row 1: no 'text', 'prompt' and 'completion', or 'messages'" in said


def chat_tokenizer(folder: Path) -> Path:
    """The test tokenizer with a template that writes a record's tools and a ``think``
    template argument into the tokens (so the store shows what the template got)."""
    from tests.support import hf_assets

    tok = hf_assets.load_tokenizer()
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='name') | join(',') }}"
        "<|im_end|>\n{% endif %}{% if think is defined %}<|im_start|>system\nthink: "
        "{{ think }}<|im_end|>\n{% endif %}" + hf_assets.CHAT_TEMPLATE
    )
    tok.save_pretrained(folder)
    return folder


def stored_text(err: str, tok: Path) -> str:
    """The validation tokens of the store the run said it built, decoded with ``tok``."""
    from transformers import AutoTokenizer

    store = Path(re.search(r"data: tokenized .* into (\S+)", err)[1])
    ids = np.fromfile(store / "val.ids", dtype=np.int32).tolist()
    return AutoTokenizer.from_pretrained(str(tok)).decode(ids)


def test_chat_records_with_tools_and_template_kwargs_through_the_cli(
    tmp_path, llama, capsys, monkeypatch
) -> None:
    """--messages-field names the conversation, a record's tools and
    --chat-template-kwargs reach the template; another setting or an edited tokenizer is
    another store, the same settings reuse it."""
    monkeypatch.setenv("GRADSTEP_CACHE", str(tmp_path / "cache" / "x"))
    tok = chat_tokenizer(tmp_path / "tok")
    tools = [{"name": "search", "parameters": {"type": "object"}}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"name": "search"}]}
    records = [
        {"conversation": [{"role": "user", "content": f"find {i}"}, call,
                          {"role": "tool", "content": f"found {i}"},
                          {"role": "assistant", "content": f"it is {i}"}],
         "tools": tools, "text": "ignored: --messages-field reads conversations only"}
        for i in range(8)
    ]  # fmt: skip
    data = write_format(tmp_path / "d", "jsonl", records)
    chat = ["--data", str(data), "--val-data", str(data), "--messages-field", "conversation",
            "--tokenizer", str(tok), "--seq-len", "128"]  # fmt: skip
    err = hf_train(capsys, llama, tmp_path / "a", *chat)
    assert "8 train records (8 messages;" in err and err.count("data: tokenized ") == 1, err
    text = stored_text(err, tok)
    assert text.count("tools: search") == 8 and "think:" not in text and "ignored" not in text
    kwargs = ["--chat-template-kwargs", '{"think": "off"}']
    err = hf_train(capsys, llama, tmp_path / "b", *chat, *kwargs)
    assert err.count("data: tokenized ") == 1, err  # another setting: another store
    assert stored_text(err, tok).count("think: off") == 8
    err = hf_train(capsys, llama, tmp_path / "c", *chat, *kwargs)
    assert "data: reused the token store" in err and "data: tokenized" not in err
    from transformers import AutoTokenizer

    edited = AutoTokenizer.from_pretrained(str(tok))  # the same folder, another template
    edited.chat_template = edited.chat_template.replace("think: ", "thinking: ")
    edited.save_pretrained(tok)
    err = hf_train(capsys, llama, tmp_path / "d", *chat, *kwargs)
    assert err.count("data: tokenized ") == 1, err  # the stale store is not reused
    assert stored_text(err, tok).count("thinking: off") == 8
