"""The flags of ``gradstep train`` and ``gradstep plan`` (gradstep_cli.config.flags): one per
``TrainConfig`` field, grouped by section in ``--help``."""

from __future__ import annotations

import dataclasses

import pytest

from gradstep_cli.cli import main
from gradstep_cli.config.settings import SECTIONS, TrainConfig


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in text
    assert "--config" in text


def test_train_help_names_both_models(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "train the demo GPT or a Hugging Face causal LM" in text
    assert "fine-tune a Hugging Face causal LM (--model hf:DIR: its weights and tokenizer)" in text
    assert "byte-level text" not in text  # hf: models read their tokenizer's text, and JSONL


def test_every_field_has_a_section_and_help_groups_them_in_order(capsys):
    assert {f.metadata["section"] for f in dataclasses.fields(TrainConfig)} == set(SECTIONS)
    for command in ("train", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        lines = capsys.readouterr().out.splitlines()
        titles = [line[:-1] for line in lines if line[:-1] in SECTIONS and line.endswith(":")]
        assert titles == list(SECTIONS), command
        for f in dataclasses.fields(TrainConfig):  # each flag under its own section's title
            flag = "--" + f.name.replace("_", "-")
            at = next(i for i, line in enumerate(lines) if line.split(maxsplit=1)[:1] == [flag]
                      or line.split(",")[0].strip() == flag)  # fmt: skip
            above = [line[:-1] for line in lines[:at] if line[:-1] in SECTIONS]
            assert above[-1] == f.metadata["section"], (command, f.name)
