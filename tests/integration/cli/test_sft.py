"""The tests of tests/cli/test_sft.py that start processes or run the CLI end to end; its other
tests stay there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from gradstep_cli.cli import main as gradstep_main
from tests.cli import test_sft
from tests.cli.test_sft import (
    CLI,
    chats,
    cut,
    pairs,
    plain_chat,
    plain_pair,
    reference,
    texts,
    write_jsonl,
)
from tests.support import hf_assets

# Fixtures shared with tests/cli/test_sft.py.
llama_dir = test_sft.llama_dir
tok = test_sft.tok


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


FORMATS = {
    "prompt/completion": (pairs, plain_pair),
    "messages": (chats, plain_chat),
    "text": (texts, None),
}


@pytest.mark.parametrize("kind", list(FORMATS))
def test_cli_fine_tunes_each_format(
    kind: str, tmp_path: Path, tok: Any, llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gradstep train --model hf:DIR --data train.jsonl --val-data val.jsonl`: the first
    step trains on exactly the completion / assistant tokens of its records (one epoch of 8
    records per step), evaluation runs on the same kind of tokens."""
    make, plain = FORMATS[kind]
    train = write_jsonl(tmp_path / "train.jsonl", make(8) if kind != "text" else make(3))
    val = write_jsonl(tmp_path / "val.jsonl", make(2, offset=40) if kind != "text" else make(1))
    out = tmp_path / "run"
    args = ["train", "--model", f"hf:{llama_dir}", "--data", str(train), "--val-data", str(val)]
    assert gradstep_main([*args, *CLI, "--max-steps", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"data: {train}: " in err and "val records" in err
    rows = _rows(out)
    assert len(rows) == 2 and all(r["items"] > 0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["corpus"].startswith(f"{train}: ") and rows[-1]["val_loss"] > 0
    if plain is not None:
        sequences = [cut(plain(tok, r)) for r in make(8)]
        assert rows[0]["items"] == sum(sum(t[1:]) for _, t in sequences)
        # The loaded weights' validation loss: completion / assistant tokens, token-weighted
        # (float32 run vs float64 reference).
        base = hf_assets.build_model("llama", seed=0).double()
        _, want, _ = reference(base, [cut(plain(tok, r)) for r in make(2, offset=40)])
        assert summary["initial_val_loss"] == pytest.approx(want, rel=1e-5)


def test_cli_text_files_are_tokenized(tmp_path: Path, llama_dir: Path) -> None:
    """Plain text files with an HF model: the tokenizer's tokens, EOS after each file."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(6):
        (folder / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    out = tmp_path / "run"
    args = ["train", "--model", f"hf:{llama_dir}", "--data", str(folder), *CLI]
    assert gradstep_main([*args, "--max-steps", "1", "--out", str(out)]) == 0
    corpus = json.loads((out / "summary.json").read_text())["corpus"]
    assert "train docs" in corpus and "tokens" in corpus


def test_jsonl_run_resumes_exactly(tmp_path: Path, llama_dir: Path) -> None:
    """A JSONL run stopped after a checkpoint and resumed takes the same steps as one that
    never stopped (the stream's position, the records' order, every loss and update), with
    an exact --global-batch split into micro-batches of unequal size."""
    train = write_jsonl(tmp_path / "train.jsonl", pairs(10) + chats(10))
    args = ["train", "--model", f"hf:{llama_dir}", "--data", str(train), *CLI]
    args += ["--global-batch", "5", "--micro-batch-size", "2", "--max-steps", "4"]
    out = tmp_path / "run"
    assert gradstep_main([*args, "--save-every", "2", "--out", str(out)]) == 0
    straight = _rows(out)
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    final = (checkpoints[-1] / "model.safetensors").read_bytes()
    shutil.rmtree(checkpoints[-1])  # as if the run had stopped after step 2
    assert gradstep_main([*args, "--resume", "--out", str(out)]) == 0
    keys = ("step", "loss", "grad_norm", "items", "clip_coef", "lr", "val_loss")
    pick = lambda rows: [{k: r.get(k) for k in keys} for r in rows]  # noqa: E731
    assert pick(_rows(out)) == pick(straight) and len(straight) == 4
    assert (
        sorted((out / "checkpoints").glob("step-*"))[-1] / "model.safetensors"
    ).read_bytes() == final


def test_jsonl_folder_trains_with_a_batch_ramp(tmp_path: Path, llama_dir: Path) -> None:
    """A folder of JSONL files (records named by their path in it) under --batch-ramp: the
    window grows, every step trains on completion / assistant tokens only."""
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "pairs.jsonl", pairs(12))
    write_jsonl(folder / "sub" / "chats.jsonl", chats(12))
    out = tmp_path / "run"
    args = ["train", "--model", f"hf:{llama_dir}", "--data", str(folder), *CLI]
    assert gradstep_main([*args, "--batch-ramp", "1:2", "--max-steps", "3", "--out", str(out)]) == 0
    rows = _rows(out)
    assert [r["micro_batches"] for r in rows][:2] == [1, 2] and all(r["items"] > 0 for r in rows)
    assert "prompt/completion" in json.loads((out / "summary.json").read_text())["corpus"]
