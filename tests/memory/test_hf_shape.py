"""The HF shape's parameters against the real model: every tensor, exactly.

``from_hf_config`` reads only the config; the model built from the same config (and
wrapped by PEFT the way ``gradstep train --lora`` wraps it) must hold exactly the tensors
the shape lists, trainable and frozen, so that parameters, gradients and optimizer state
are counted to the byte, and LoRA's frozen base once, without gradient or state.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from gradstep.memory import estimate_step_memory
from gradstep.memory.hf_config import from_hf_config, lora_targets
from tests.memory.hf_saved import build, config
from tests.support.hf_assets import FAMILIES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

LORA_TARGETS = {
    "default": None,  # PEFT's default for the model type, else all-linear (as train does)
    "all": "all-linear",
    "named": "q_proj,v_proj,down_proj,dense,fc2,gate_up_proj",  # + expert tensors
    "router": "gate,k_proj",  # OLMoE's router (PEFT refuses Qwen2-MoE's: so does train)
}


def _lora(model: torch.nn.Module, names: list[str]) -> dict:
    """PEFT's config for ``names`` as ``hf_model.add_lora`` builds it: modules by name,
    3-D expert tensors by parameter name (``target_parameters``)."""
    if names == ["all-linear"]:
        return {"r": 4, "target_modules": "all-linear"}
    modules = {n for n, _ in model.named_modules()}
    hit = [t for t in names if any(m == t or m.endswith("." + t) for m in modules)]
    params = [t for t in names if t not in hit and any(
        n.endswith("." + t) for n, p in model.named_parameters() if p.dim() == 3
    )]  # fmt: skip
    return {"r": 4, "target_modules": hit or None, "target_parameters": params or None}


def counts(model: torch.nn.Module) -> tuple[Counter, Counter]:
    params = list(model.parameters())
    return (
        Counter(tuple(p.shape) for p in params),
        Counter(tuple(p.shape) for p in params if p.requires_grad),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_tensor_of_every_family_is_counted(family):
    cfg = config(family, layers=3)
    model = build(cfg)
    shape = from_hf_config(cfg, 16)
    every, trainable = counts(model)
    assert Counter(shape.all_tensors()) == every
    assert Counter(shape.trainable_tensors()) == trainable
    assert shape.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("targets", list(LORA_TARGETS))
def test_lora_adapters_and_the_frozen_base_are_counted(family, targets):
    cfg = config(family, layers=2)
    names = lora_targets(cfg, LORA_TARGETS[targets])
    base = build(cfg)
    known = {n.rsplit(".", 1)[-1] for n, _ in base.named_modules()}
    known |= {n.rsplit(".", 1)[-1] for n, p in base.named_parameters() if p.dim() == 3}
    names = [n for n in names if n == "all-linear" or n in known]  # train refuses others
    if targets == "router" and family != "olmoe":
        names = [n for n in names if n != "gate"]
    if not names:
        pytest.skip(f"{LORA_TARGETS[targets]} names nothing in {family}: train refuses it")
    model = build(cfg, lora=_lora(base, names))
    shape = from_hf_config(cfg, 16, lora_rank=4, lora_targets=names)
    every, trainable = counts(model)
    assert Counter(shape.all_tensors()) == every
    assert Counter(shape.trainable_tensors()) == trainable
    assert 0 < shape.trainable_params < shape.params


@pytest.mark.parametrize("family", ["llama", "olmoe"])
def test_model_states_are_the_trainable_count_times_the_dtype(family):
    """Parameters: every tensor once (frozen ones in their own dtype); gradients, AdamW's
    two states and its step temporaries: trainable ones only."""
    cfg = config(family, layers=2)
    model = build(cfg, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = from_hf_config(cfg, 16, lora_rank=4, lora_targets=["q_proj", "v_proj"])
    est = estimate_step_memory(shape, 1, frozen_dtype=torch.bfloat16)
    assert est.params == frozen * 2 + trained * 4
    assert est.grads == trained * 4
    assert est.optimizer == 2 * trained * 4
    assert est.accum_buffers == 0  # float32 adapters: no float32 buffers needed
    full = estimate_step_memory(from_hf_config(cfg, 16), 1, optimizer="sgd_momentum")
    n = sum(p.numel() for p in build(cfg).parameters())
    assert (full.params, full.grads, full.optimizer) == (n * 4, n * 4, n * 4)


def test_a_tied_head_is_counted_once_and_an_untied_one_twice():
    tied = from_hf_config(config("llama", tie_word_embeddings=True), 8)
    untied = from_hf_config(config("llama", tie_word_embeddings=False), 8)
    assert untied.params - tied.params == tied.vocab_size * tied.d_model
    for cfg in (config("llama", tie_word_embeddings=True), config("opt")):
        assert from_hf_config(cfg, 8).params == sum(p.numel() for p in build(cfg).parameters())


def test_unknown_families_and_layouts_are_refused_by_name():
    cfg = config("llama")
    cfg.model_type = "mamba"
    with pytest.raises(ValueError, match="does not know model_type 'mamba'"):
        from_hf_config(cfg, 8)
    with pytest.raises(ValueError, match="word_embed_proj_dim"):
        from_hf_config(config("opt", word_embed_proj_dim=16), 8)


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_predictions_grow_with_the_micro_batch_and_the_sequence(family):
    cfg = config(family, layers=2)
    for ckpt in (False, True):
        peaks = [
            estimate_step_memory(from_hf_config(cfg, 32), b, activation_checkpointing=ckpt).total
            for b in (1, 2, 3, 5, 8)
        ]
        assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
    short = estimate_step_memory(from_hf_config(cfg, 16), 4).total
    assert short < estimate_step_memory(from_hf_config(cfg, 64), 4).total
