"""`gradstep train --model hf:PATH` with --lora and --aux-loss-coef: tiny configs written
to a temporary folder (random init, nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep_demo.cli import main  # noqa: E402

TINY = [
    "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "2",
    "--eval-every", "0", "--sample-tokens", "4", "--warmup", "1",
]  # fmt: skip
SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _config(folder: Path, kind: str, vocab: int = 256) -> Path:
    from transformers import LlamaConfig, MixtralConfig

    if kind == "llama":
        config = LlamaConfig(vocab_size=vocab, **SHAPE)
    else:
        config = MixtralConfig(
            vocab_size=vocab, num_local_experts=4, num_experts_per_tok=2, **SHAPE
        )
    config.save_pretrained(folder / kind)
    return folder / kind


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_run_resumes_exactly_from_an_adapter_only_checkpoint(tmp_path: Path) -> None:
    path = _config(tmp_path, "llama") / "config.json"  # a config.json file works too
    run = ["train", *TINY, "--model", f"hf:{path}", "--lora", "4", "--clip", "agc"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main([*run, "--max-steps", "4", "--out", str(straight)]) == 0
    assert main([*run, "--max-steps", "2", "--save-every", "2", "--out", str(split)]) == 0
    assert main([*run, "--max-steps", "4", "--resume", "--out", str(split)]) == 0
    keys = ("step", "loss", "grad_norm", "items", "clip_coef", "lr")  # val_loss: a run's end
    pick = lambda rows: [{k: r.get(k) for k in keys} for r in rows]  # noqa: E731
    assert pick(_rows(split)) == pick(_rows(straight)) and len(_rows(split)) == 4
    assert _rows(split)[-1]["val_loss"] == _rows(straight)[-1]["val_loss"]
    from safetensors import safe_open

    ckpt = next((split / "checkpoints").glob("step-*")) / "model.safetensors"
    with safe_open(str(ckpt), "pt") as f:
        assert all("lora_" in k for k in f.keys())  # noqa: SIM118


def test_moe_aux_loss_is_reported_beside_the_loss(tmp_path: Path) -> None:
    path = _config(tmp_path, "mixtral")
    out = tmp_path / "moe"
    run = ["train", *TINY, "--model", f"hf:{path}", "--aux-loss-coef", "0.02", "--out", str(out)]
    assert main([*run, "--max-steps", "2"]) == 0
    rows = _rows(out)
    assert all(0 < r["aux"]["router"] < 1 for r in rows)  # coef 0.02 x aux ~ n_experts


def test_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = _config(tmp_path, "llama", vocab=100)
    assert main(["train", *TINY, "--model", f"hf:{small}", "--out", str(tmp_path / "a")]) == 2
    assert "vocab_size must be >= 256" in capsys.readouterr().err
    missing = f"hf:{tmp_path / 'nothing'}"
    assert main(["train", *TINY, "--model", missing, "--out", str(tmp_path / "b")]) == 2
    assert "neither a config.json" in capsys.readouterr().err
    assert main(["train", *TINY, "--lora", "2", "--out", str(tmp_path / "c")]) == 2
    assert "lora needs model hf:PATH" in capsys.readouterr().err
