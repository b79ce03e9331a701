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


def test_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = _config(tmp_path, "llama", vocab=100)
    assert main(["train", *TINY, "--model", f"hf:{small}", "--out", str(tmp_path / "a")]) == 2
    assert "vocab_size must be >= 256" in capsys.readouterr().err
    missing = f"hf:{tmp_path / 'nothing'}"
    assert main(["train", *TINY, "--model", missing, "--out", str(tmp_path / "b")]) == 2
    assert "neither a config.json" in capsys.readouterr().err
    assert main(["train", *TINY, "--lora", "2", "--out", str(tmp_path / "c")]) == 2
    assert "--lora needs --model hf:PATH" in capsys.readouterr().err


def _notes(tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, **cfg: object) -> str:
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.models.hf import hf_config

    capsys.readouterr()
    hf_config(TrainConfig(model=f"hf:{model}", seq_len=32, **cfg))
    return capsys.readouterr().err


def test_a_moe_without_its_router_loss_says_so_once(tmp_path, capsys):
    """hf-client friction 4: a MoE config ships output_router_logits false; without
    --aux-loss-coef the run trained with no load balancing and no word about it."""
    moe = _config(tmp_path, "mixtral")
    err = _notes(tmp_path, capsys, moe)
    assert err.count("\n") == 1 and "router load-balancing loss is off" in err
    assert "--aux-loss-coef" in err and "0.001" in err  # Mixtral's default coefficient
    assert _notes(tmp_path, capsys, moe, aux_loss_coef=0.02) == ""  # turned on: no note
    from transformers import AutoConfig

    on = AutoConfig.from_pretrained(str(moe))
    on.output_router_logits = True  # the config's own loss is on
    on.save_pretrained(tmp_path / "moe_on")
    assert _notes(tmp_path, capsys, tmp_path / "moe_on") == ""
    assert _notes(tmp_path, capsys, _config(tmp_path, "llama")) == ""  # dense: nothing to say


def test_lora_shows_no_transformers_deprecation_warning(tmp_path):
    """N68/N69: every --lora run printed transformers' FutureWarning about
    is_gradient_checkpointing (PEFT reads the deprecated property)."""
    import warnings

    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.models.hf import build_model

    cfg = TrainConfig(model=f"hf:{_config(tmp_path, 'llama')}", seq_len=32, lora=2)
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_model(cfg)
        warnings.warn("still shown", FutureWarning, stacklevel=1)  # the filter is local
    assert [str(w.message) for w in caught] == ["still shown"], [str(w.message) for w in caught]
    assert warnings.filters == before
    assert any("lora_" in name for name, _ in model.named_parameters())


def test_lora_on_fused_experts_shows_no_peft_internal_warning(tmp_path):
    """PEFT's all-linear on Qwen3-MoE renames its own rank pattern for transformers 5's
    fused experts and warns that the pattern matched nothing: PEFT's internals, not the
    user's flags."""
    import warnings

    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.models.hf import build_model
    from tests.support import hf_assets

    folder = hf_assets.model_dir(tmp_path / "moe", "qwen3_moe", weights="none", tokenizer=False)
    cfg = TrainConfig(model=f"hf:{folder}", seq_len=32, lora=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_model(cfg)
    assert [str(w.message) for w in caught] == []


def test_train_help_names_both_models(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "train the demo GPT or a Hugging Face causal LM" in text
    assert "fine-tune a Hugging Face causal LM (--model hf:DIR: its weights and tokenizer)" in text
    assert "byte-level text" not in text  # hf: models read their tokenizer's text, and JSONL
