"""``--model hf:DIR`` loads DIR's pretrained weights (issue 21 §1): every weight format gives
the saved parameters bitwise, ``--init random`` and weight-less folders give the seed's
init, a folder whose weights belong to another config is a clear error, and the dtype
follows the precision. Folders come from tests/support/hf_assets.py (nothing downloaded)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep_cli.cli import main  # noqa: E402
from tests.support import hf_assets  # noqa: E402


def _zero_head_folder(dest: Path) -> Path:
    """A pretrained folder whose output layer is zero: every logit is 0, so the loss of any
    data is exactly ln(vocab) when (and only when) these weights are the ones loaded."""
    model = hf_assets.build_model("llama", seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(dest)
    hf_assets.load_tokenizer().save_pretrained(dest)
    return dest


def test_the_cli_trains_from_the_folders_weights(tmp_path, capsys) -> None:
    """hf-client friction 1: the folder's weights were silently ignored (random init)."""
    folder = _zero_head_folder(tmp_path / "zero_head")
    data = tmp_path / "data.txt"
    data.write_text(hf_assets.training_text(40_000)[0][:40_000])
    tiny = [
        "train", "--model", f"hf:{folder}", "--data", str(data), "--seq-len", "32",
        "--micro-batch-size", "2", "--max-steps", "1", "--eval-batches", "1",
        "--sample-tokens", "0", "--lr", "1e-9",
    ]  # fmt: skip
    capsys.readouterr()
    assert main([*tiny, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    n = sum(p.numel() for p in hf_assets.build_model("llama").parameters())
    assert f"loaded pretrained weights from {folder} ({n:,} parameters)" in err
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["initial_val_loss"] == pytest.approx(math.log(hf_assets.VOCAB), abs=2e-6)
    assert main([*tiny, "--init", "random", "--out", str(tmp_path / "b")]) == 0
    assert "--init random: model.safetensors" in capsys.readouterr().err
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert abs(summary["initial_val_loss"] - math.log(hf_assets.VOCAB)) > 1e-3
