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
