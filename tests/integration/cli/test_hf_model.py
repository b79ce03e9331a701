"""`gradstep train --model hf:PATH` with --lora and --aux-loss-coef: tiny configs written
to a temporary folder (random init, nothing downloaded). Pretrained weights and the
tokenizer: test_hf_pretrained*.py; LoRA on every family: test_lora_families.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep_cli.cli import main  # noqa: E402

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


def test_lora_run_resumes_exactly_from_an_adapter_only_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, "llama") / "config.json"  # a config.json file works too
    run = ["train", *TINY, "--model", f"hf:{path}", "--lora", "4", "--clip", "agc"]
    out = tmp_path / "run"
    assert main([*run, "--max-steps", "4", "--save-every", "2", "--out", str(out)]) == 0
    # hf-client friction 12: the end-of-run line gave the total only. LoRA r=4 on PEFT's
    # llama targets q_proj (32 -> 32) and v_proj (32 -> 2 kv heads x 8 = 16), per layer:
    # r x in + out x r = 4*32 + 32*4 + 4*32 + 16*4 = 448; 2 layers: 896 trainable.
    total = json.loads((out / "summary.json").read_text())["parameters"]
    line = f"{total:,} parameters, 896 trainable ({100 * 896 / total:.2f}%)"
    assert line in capsys.readouterr().out
    straight = _rows(out)
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 2
    shutil.rmtree(checkpoints[-1])  # as if the run had stopped after step 2
    assert main([*run, "--max-steps", "4", "--resume", "--out", str(out)]) == 0
    keys = ("step", "loss", "grad_norm", "items", "clip_coef", "lr")  # val_loss: a run's end
    pick = lambda rows: [{k: r.get(k) for k in keys} for r in rows]  # noqa: E731
    assert pick(_rows(out)) == pick(straight) and len(straight) == 4
    assert _rows(out)[-1]["val_loss"] == straight[-1]["val_loss"]
    from safetensors import safe_open

    ckpt = next((out / "checkpoints").glob("step-*")) / "model.safetensors"
    with safe_open(str(ckpt), "pt") as f:
        assert all("lora_" in k for k in f.keys())  # noqa: SIM118


def test_moe_aux_loss_is_reported_beside_the_loss(tmp_path: Path) -> None:
    path = _config(tmp_path, "mixtral")
    out = tmp_path / "moe"
    run = ["train", *TINY, "--model", f"hf:{path}", "--aux-loss-coef", "0.02", "--out", str(out)]
    assert main([*run, "--max-steps", "2"]) == 0
    rows = _rows(out)
    assert all(0 < r["aux"]["router"] < 1 for r in rows)  # coef 0.02 x aux ~ n_experts
