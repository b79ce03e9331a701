"""``--lora R --lora-alpha A --lora-dropout P --lora-targets ...`` (issue 21 §3): adapters
on every family hf-client-2 tried, MoE included (PEFT's default targets where it has them,
else all-linear); one Stepper step moves only the adapters and leaves the base bitwise."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep import Stepper  # noqa: E402
from gradstep_cli.cli import main  # noqa: E402
from gradstep_cli.config.settings import ConfigError, TrainConfig  # noqa: E402
from gradstep_cli.models.hf import HFLoss, count_batch  # noqa: E402
from gradstep_cli.models.lora import adapted, add_lora  # noqa: E402
from tests.support import hf_assets  # noqa: E402

# What the default (no --lora-targets) resolves to: PEFT's table, else all-linear. On
# Qwen3-MoE and OLMoE PEFT's all-linear also adapts the experts' 3-D weights and the router.
DEFAULTS = {
    "qwen2": ("q_proj", "v_proj"),
    "phi3": ("down_proj", "gate_up_proj", "o_proj", "qkv_proj"),
    "phi": ("fc1", "fc2", "q_proj", "v_proj"),
    "gpt_neox": ("query_key_value",),
    "opt": ("q_proj", "v_proj"),
    "qwen2_moe": (
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "shared_expert_gate", "up_proj",
        "v_proj",
    ),
    "qwen3_moe": (
        "experts.down_proj", "experts.gate_up_proj", "gate.weight", "k_proj", "o_proj", "q_proj",
        "v_proj",
    ),
    "olmoe": (
        "experts.down_proj", "experts.gate_up_proj", "gate.weight", "k_proj", "o_proj", "q_proj",
        "v_proj",
    ),
    "granitemoe": ("k_proj", "o_proj", "q_proj", "v_proj"),
}  # fmt: skip


def _cfg(**kw: object) -> TrainConfig:
    return TrainConfig(model="hf:unused", seq_len=32, **kw)


def _window(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches of pre-shifted labels, one with ignored targets."""
    gen = torch.Generator().manual_seed(seed)
    window = []
    for ignored in (0, 5):
        ids = torch.randint(0, hf_assets.VOCAB, (2, 17), generator=gen)
        labels = ids[:, 1:].clone()
        labels[1, labels.shape[1] - ignored :] = -100
        window.append({"input_ids": ids[:, :-1], "labels": labels})
    return window


def _one_step(model: torch.nn.Module) -> float:
    model.train()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0
    )
    stats = Stepper(model, opt).step(_window(), HFLoss(torch.device("cpu")), count=count_batch)
    assert not stats.skipped
    return stats.loss


@pytest.mark.parametrize("family", hf_assets.REVIEW_FAMILIES)
def test_lora_trains_only_the_adapters_on_every_family(family, capsys) -> None:
    model = add_lora(hf_assets.build_model(family, seed=0), _cfg(lora=4))
    assert tuple(adapted(model)) == DEFAULTS[family]
    source = "PEFT's default" if family in ("qwen2", "phi", "gpt_neox", "opt") else "all-linear"
    line = capsys.readouterr().err
    assert "LoRA rank 4, alpha 8 (scale alpha/rank = 2), dropout 0: adapters on " in line
    assert f"{', '.join(DEFAULTS[family])} ({source}" in line
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n or "embed_out" in n for n in trainable)  # the head: no LoRA
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert math.isfinite(_one_step(model))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at 0 and has the only nonzero gradient at step 1
            assert not torch.equal(p, before[name]), name
        elif name not in trainable:
            assert torch.equal(p, before[name]), name  # the base, bitwise


def test_alpha_dropout_and_targets_reach_peft(capsys) -> None:
    model = add_lora(
        hf_assets.build_model("llama"),
        _cfg(lora=4, lora_alpha=12.0, lora_dropout=0.1, lora_targets="q_proj, k_proj"),
    )
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 12.0, 0.1)
    assert set(config.target_modules) == {"q_proj", "k_proj"}
    assert adapted(model) == ["k_proj", "q_proj"]
    dropout = model.base_model.model.model.layers[0].self_attn.q_proj.lora_dropout["default"]
    assert isinstance(dropout, torch.nn.Dropout) and dropout.p == 0.1
    err = capsys.readouterr().err
    assert "LoRA rank 4, alpha 12 (scale alpha/rank = 3), dropout 0.1: adapters on k_proj, " in err
    assert "(--lora-targets)" in err


def test_all_linear_adapts_every_linear_layer_but_the_head() -> None:
    model = add_lora(hf_assets.build_model("llama"), _cfg(lora=2, lora_targets="all-linear"))
    expected = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert adapted(model) == expected  # PEFT's all-linear on the bare model: no lm_head


def test_expert_weights_can_be_named(capsys) -> None:
    """A NAME that is a 3-D expert weight (no module of that name) goes to PEFT's
    target_parameters."""
    model = add_lora(
        hf_assets.build_model("qwen3_moe"), _cfg(lora=2, lora_targets="q_proj,gate_up_proj")
    )
    config = model.peft_config["default"]
    assert set(config.target_modules) == {"q_proj"}
    assert set(config.target_parameters) == {"gate_up_proj"}
    assert adapted(model) == ["experts.gate_up_proj", "q_proj"]
    assert math.isfinite(_one_step(model))


@pytest.mark.parametrize(
    ("family", "kw", "message"),
    [
        (
            "llama",
            {"lora_targets": "q_proj,qkv"},
            "--lora-targets: qkv matches no module of this llama model; its linear layers are "
            "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or pass all-linear)",
        ),
        (
            "qwen3_moe",
            {"lora_targets": "gate_proj"},  # transformers 4's name: experts are fused in 5
            "its expert weights down_proj, gate_up_proj",
        ),
        ("llama", {"lora_targets": "mlp"}, "--lora-targets: PEFT cannot place adapters"),
        ("llama", {"lora_targets": " , "}, "--lora-targets must be all-linear or NAME,NAME"),
        ("olmoe", {"lora_dropout": 0.1}, "--lora-dropout 0.1: PEFT cannot apply dropout"),
    ],
)
def test_targets_lora_cannot_use_are_clear_errors(family, kw, message) -> None:
    with pytest.raises(ConfigError) as err:
        add_lora(hf_assets.build_model(family), _cfg(lora=2, **kw))
    assert message in str(err.value)


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
