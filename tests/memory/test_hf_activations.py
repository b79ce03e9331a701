"""The HF activation formula against what autograd really keeps, family by family.

Every tensor saved for backward in one forward + loss is recorded (``saved_tensors_hooks``,
distinct storages, parameters left out): the formula's saved terms (plus autocast's weight
copies) must add up to it. Full fine-tuning: to the byte, for every family, in float32,
float32 under bf16 autocast, and bf16 parameters, at several widths, depths, heads, row
counts and lengths. LoRA (frozen base, adapters on PEFT's default targets, on all linears,
with adapter dropout, over a float32 or a bf16 base): within 7%, on the safe side mostly;
the rest are which frozen weights' cast copies the first layer keeps.
"""

from __future__ import annotations

import pytest
import torch

from gradstep.memory.activations import _Bytes
from gradstep.memory.hf_activations import hf_saved_bytes
from gradstep.memory.hf_config import from_hf_config
from tests.memory.hf_saved import LOSS_SCALAR, build, config, saved_bytes
from tests.support.hf_assets import FAMILIES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# (layers, width, MLP width, rows, length): odd sizes, so that no two terms coincide.
SHAPES = [(1, 48, 40, 1, 5), (2, 64, 88, 2, 9), (3, 32, 24, 3, 4)]
REGIMES = {  # (parameter bytes, compute bytes, autocast)
    "fp32": (4, 4, False),
    "amp": (4, 2, True),
    "bf16": (2, 2, True),
}


def family_config(family: str, layers: int, width: int, ff: int) -> object:
    """A config of ``family`` with these sizes (head_dim kept apart from width / heads
    where the family reads it from the config)."""
    sizes = {"hidden_size": width}
    sizes["ffn_dim" if family == "opt" else "intermediate_size"] = ff
    if family == "opt":
        sizes["word_embed_proj_dim"] = width
    if family in ("llama", "qwen2", "qwen2_moe"):
        sizes["head_dim"] = 8
    if family in ("qwen2_moe", "olmoe"):
        sizes |= {"moe_intermediate_size": ff // 2 + 4, "shared_expert_intermediate_size": ff - 4}
    return config(family, layers, **sizes)


def predicted(shape: object, regime: str, rows: int) -> int:
    """The formula's saved bytes plus autocast's kept weight copies (each part of the
    weights, base and adapters, copied when its dtype is not the compute dtype)."""
    if regime == "base_bf16":  # a bf16 base, float32 adapters: train's --lora --precision bf16
        sizes, amp, base, adapters = _Bytes(4, 2, 2, 2, frozen=2), True, 2, 4
    else:
        param, compute, amp = REGIMES[regime]
        sizes, base, adapters = _Bytes(param, compute, param, param), param, param
    copies = shape.matmul_numel(None, "base") * 2 if amp and base == 4 else 0
    copies += shape.matmul_numel(None, "adapters") * 2 if amp and adapters == 4 else 0
    return hf_saved_bytes(shape, sizes, rows) + copies


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("regime", list(REGIMES))
def test_full_fine_tuning_saves_what_the_formula_says_to_the_byte(family, regime):
    for layers, width, ff, rows, length in SHAPES:
        cfg = family_config(family, layers, width, ff)
        model = build(cfg)
        if regime == "bf16":
            model = model.to(torch.bfloat16)
        real = saved_bytes(model, rows, length, amp=REGIMES[regime][2]) - LOSS_SCALAR
        shape = from_hf_config(cfg, length)
        assert predicted(shape, regime, rows) == real, (layers, width, ff, rows, length)


LORA = {
    "default": {"r": 4, "target_modules": ["q_proj", "v_proj", "query_key_value", "qkv_proj"]},
    "all": {"r": 4, "target_modules": "all-linear"},
    "dropout": {
        "r": 4,
        "target_modules": ["q_proj", "v_proj", "query_key_value", "qkv_proj"],
        "lora_dropout": 0.1,
    },
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lora", list(LORA))
def test_lora_saves_what_the_formula_says_within_7_percent(family, lora):
    kwargs = LORA[lora]
    targets = kwargs["target_modules"]
    names = [targets] if isinstance(targets, str) else targets
    worst = 0.0
    for layers, width, ff, rows, length in SHAPES[:2]:
        cfg = family_config(family, layers, width, ff)
        shape = from_hf_config(
            cfg, length, lora_rank=4, lora_targets=names, lora_dropout=kwargs.get("lora_dropout", 0)
        )
        for regime in ("fp32", "amp", "base_bf16"):
            if regime == "base_bf16":
                from peft import LoraConfig, get_peft_model
                from transformers import AutoModelForCausalLM

                torch.manual_seed(0)
                base = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
                model = get_peft_model(base, LoraConfig(**kwargs)).train()
                real = saved_bytes(model, rows, length, amp=True) - LOSS_SCALAR
            else:
                model = build(cfg, lora=kwargs)
                real = saved_bytes(model, rows, length, amp=regime == "amp") - LOSS_SCALAR
            pred = predicted(shape, regime, rows)
            worst = max(worst, abs(pred / real - 1))
            assert abs(pred / real - 1) < 0.07, (regime, layers, pred, real)
    assert worst < 0.07


def test_checkpointing_keeps_one_input_per_layer_and_one_layer_recomputed():
    """With checkpointing the activations are every layer's input plus one layer's saved
    set; the saved set of a layer is what a one-layer model saves beyond its head."""
    cfg = family_config("llama", 4, 64, 88)
    shape = from_hf_config(cfg, 32)
    from gradstep.memory import estimate_step_memory

    plain = estimate_step_memory(shape, 2).activations
    ckpt = estimate_step_memory(shape, 2, activation_checkpointing=True).activations
    assert ckpt < plain / 2
    assert estimate_step_memory(shape, 4, activation_checkpointing=True).activations > ckpt


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@pytest.mark.parametrize("lora", [None, "all-linear"])
def test_qwen3_and_mistral_too(family, lora):
    """Two more families the memory model knows, beyond tests/support/hf_assets' seven:
    Qwen3's per-head q/k norms, Mistral's Llama layout; parameters and saved bytes exact."""
    from collections import Counter

    import transformers

    kind = {"qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[family]
    cfg = kind(vocab_size=512, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    shape = from_hf_config(cfg, 9, lora_rank=4 if lora else 0, lora_targets=[lora] * bool(lora))
    for regime in REGIMES:
        model = build(cfg, lora={"r": 4, "target_modules": lora} if lora else None)
        assert Counter(tuple(p.shape) for p in model.parameters()) == Counter(shape.all_tensors())
        if regime == "bf16":
            model = model.to(torch.bfloat16)
        real = saved_bytes(model, 2, 9, amp=REGIMES[regime][2]) - LOSS_SCALAR
        assert predicted(shape, regime, 2) == real, regime


@pytest.mark.parametrize(
    ("family", "dropout"),
    [
        ("opt", {"dropout": 0.1}),
        ("phi3", {"resid_pdrop": 0.1}),
        ("gpt_neox", {"hidden_dropout": 0.1}),
    ],
)
def test_residual_dropout_masks_are_counted(family, dropout):
    """Dropout on the residual branches keeps a mask per branch (in its input's dtype on
    CPU), GPT-NeoX's on the embedding one more: to the byte, with and without autocast."""
    cfg = family_config(family, 2, 48, 40)
    for key, value in dropout.items():
        setattr(cfg, key, value)
    shape = from_hf_config(cfg, 9)
    assert shape.dropout == 0.1
    for regime in ("fp32", "amp"):
        real = saved_bytes(build(cfg), 2, 9, amp=REGIMES[regime][2]) - LOSS_SCALAR
        assert predicted(shape, regime, 2) == real, regime
