"""``--lora R --lora-alpha A --lora-dropout P --lora-targets ...`` (gradstep_cli.models.lora):
adapters on every family, MoE included, and refusals of targets LoRA cannot use."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep import Stepper  # noqa: E402
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
