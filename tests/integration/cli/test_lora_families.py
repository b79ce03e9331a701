"""``--lora R --lora-alpha A --lora-dropout P --lora-targets ...`` (issue 21 §3): adapters
on every family hf-client-2 tried, MoE included (PEFT's default targets where it has them,
else all-linear); one Stepper step moves only the adapters and leaves the base bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep_cli.cli import main  # noqa: E402
from tests.support import hf_assets  # noqa: E402


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "data.txt"
    data.write_text(hf_assets.training_text(40_000)[0][:40_000])
    return data


TINY = [
    "--seq-len", "32", "--micro-batch-size", "2", "--max-steps", "2", "--eval-batches", "1",
    "--sample-tokens", "0",
]  # fmt: skip


def test_cli_lora_on_a_pretrained_phi3_with_every_flag(tmp_path, capsys) -> None:
    """hf-client friction 5: --lora failed on Phi3 (no PEFT default) with no flag to fix it."""
    folder = hf_assets.model_dir(tmp_path / "phi3", "phi3")
    out = tmp_path / "run"
    flags = ["--lora", "4", "--lora-alpha", "16", "--lora-dropout", "0.1"]
    argv = ["train", *TINY, "--model", f"hf:{folder}", "--data", str(_data(tmp_path)), *flags]
    assert main([*argv, "--lora-targets", "qkv_proj,o_proj", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "loaded pretrained weights from" in err
    assert "LoRA rank 4, alpha 16 (scale alpha/rank = 4), dropout 0.1: adapters on o_proj, " in err
    # qkv_proj 32 -> 32 + 2 x 2 kv heads x 8 = 64, o_proj 32 -> 32, per layer, 2 layers:
    # r x (in + out) = 4 x (32 + 64) + 4 x (32 + 32) = 640 per layer.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainable_parameters"] == 2 * 640


def test_cli_moe_router_loss_with_pretrained_weights_and_lora(tmp_path, capsys) -> None:
    """--aux-loss-coef keeps turning the router loss on when the weights come from DIR."""
    folder = hf_assets.model_dir(tmp_path / "olmoe", "olmoe")
    out = tmp_path / "run"
    argv = ["train", *TINY, "--model", f"hf:{folder}", "--data", str(_data(tmp_path))]
    assert main([*argv, "--lora", "2", "--aux-loss-coef", "0.02", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "loaded pretrained weights from" in err and "router load-balancing" not in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # coef x the load-balancing loss, which is ~1 (its minimum) for a balanced router
    assert len(rows) == 2 and all(0.01 < r["aux"]["router"] < 0.1 for r in rows)
