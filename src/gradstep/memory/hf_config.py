"""Read an :class:`~gradstep.memory.hf_shape.HFShape` from a Hugging Face config.

Only attributes are read (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``intermediate_size``/``ffn_dim``, ``vocab_size``,
``tie_word_embeddings``, the biases, the rotary fraction, the experts and their top-k):
nothing imports transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .hf_shape import ALL_LINEAR, FAMILIES, HFShape

__all__ = ["from_hf_config", "lora_targets"]


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _rotary_dim(config: Any, head_dim: int) -> int:
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = _get(config, "partial_rotary_factor", "rotary_pct", default=factor or 1.0)
    return int(head_dim * factor)


def _moe_fields(config: Any, family: str, layers: int) -> dict[str, Any]:
    if family not in ("qwen2_moe", "olmoe"):
        return {}
    experts = int(_get(config, "num_experts", "num_local_experts"))
    if family == "olmoe":
        return {
            "experts": experts,
            "top_k": config.num_experts_per_tok,
            "expert_ff": config.intermediate_size,
        }
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only = set(getattr(config, "mlp_only_layers", None) or ())
    dense = tuple(i for i in range(layers) if i in only or experts == 0 or (i + 1) % step)
    return {
        "experts": experts,
        "top_k": config.num_experts_per_tok,
        "expert_ff": config.moe_intermediate_size,
        "shared_ff": config.shared_expert_intermediate_size,
        "dense_layers": dense,
    }


def _expert_lora(family: str, rank: int, targets: Sequence[str]) -> tuple[int, int, int]:
    """Adapters on a MoE's 3-D expert tensors and router, as rank multiples (gate_up, down,
    router). A target naming the tensor (``gate_up_proj``, ``down_proj``: PEFT's
    ``target_parameters``, where no module has that name) adapts it at rank ``r``. For
    OLMoE, whose experts transformers 5 fused, PEFT 0.21 also converts the per-expert module
    names: ``gate_proj``/``up_proj`` -> gate_up (one rank per name), ``down_proj`` -> down,
    ``gate`` -> the router, and ``all-linear`` matches all of them (nn.Linear before the
    fusion). Qwen2-MoE's ``down_proj`` is its shared expert's module, not the tensor."""
    if family not in ("olmoe", "qwen2_moe") or not rank:
        return (0, 0, 0)
    named = set(targets)
    gate_up, down, router = int("gate_up_proj" in named), 0, 0
    if family == "olmoe":
        every = ALL_LINEAR in named
        gate_up += 2 if every else len(named & {"gate_proj", "up_proj"})
        down = int(every or "down_proj" in named)
        router = int(every or "gate" in named)
    return (gate_up, down, router)


def _family_fields(config: Any, family: str) -> dict[str, Any]:
    """What the families do differently (biases, positions, dropout), from the config."""
    if family == "gpt_neox":
        bias = bool(getattr(config, "attention_bias", True))
        dropout = float(getattr(config, "hidden_dropout", 0.0) or 0.0)
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": True, "dropout": dropout}
    if family == "phi3":
        return {"dropout": float(getattr(config, "resid_pdrop", 0.0) or 0.0)}
    if family == "opt":
        bias = bool(getattr(config, "enable_bias", True))
        positions = config.max_position_embeddings + 2  # OPT's two offset rows
        biases = {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bias}
        return {**biases, "positions": positions, "dropout": config.dropout}
    if family in ("qwen2", "qwen2_moe"):
        return {"qkv_bias": bool(getattr(config, "qkv_bias", True))}
    bias = bool(getattr(config, "attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(getattr(config, "mlp_bias", False))}


def _check_supported(config: Any, family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(
            f"the memory model does not know model_type {family!r} (known: {', '.join(FAMILIES)})"
        )
    if family == "opt" and (
        config.word_embed_proj_dim != config.hidden_size
        or not config.do_layer_norm_before
        or getattr(config, "_remove_final_layer_norm", False)
    ):
        raise ValueError(
            "the memory model knows OPT with word_embed_proj_dim == hidden_size and "
            "do_layer_norm_before (OPT-350m's layout is not modelled)"
        )
    if family == "gpt_neox" and not getattr(config, "use_parallel_residual", True):
        raise ValueError("the memory model knows GPT-NeoX with use_parallel_residual only")


def from_hf_config(
    config: Any,
    seq_len: int,
    *,
    lora_rank: int = 0,
    lora_targets: Sequence[str] = (),
    lora_dropout: float = 0.0,
) -> HFShape:
    """The :class:`HFShape` of an HF ``PretrainedConfig`` for sequences of ``seq_len``.

    ``lora_rank`` > 0: the base is frozen and ``lora_targets`` (module names as PEFT
    matches them, or ``"all-linear"``) get rank-``lora_rank`` adapters. Raises ValueError
    for a ``model_type`` the memory model does not know.
    """
    family = getattr(config, "model_type", None)
    _check_supported(config, family)
    d, heads = config.hidden_size, config.num_attention_heads
    head_dim = _get(config, "head_dim", default=d // heads)
    if family in ("gpt_neox", "opt", "olmoe"):
        head_dim = d // heads  # these compute it from the width, whatever the config says
    layers = config.num_hidden_layers
    return HFShape(
        family=family,
        n_layer=layers,
        d_model=d,
        n_head=heads,
        n_kv_head=_get(config, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        d_ff=_get(config, "intermediate_size", "ffn_dim"),
        vocab_size=config.vocab_size,
        seq_len=seq_len,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rotary_dim=0 if family == "opt" else _rotary_dim(config, head_dim),
        lora_rank=lora_rank,
        lora_targets=tuple(lora_targets),
        lora_dropout=lora_dropout,
        expert_lora=_expert_lora(family, lora_rank, tuple(lora_targets)),
        **_family_fields(config, family),
        **_moe_fields(config, family, layers),
    )


def lora_targets(config: Any, spec: str | None) -> list[str]:
    """LoRA targets as names: ``spec`` (``NAME,NAME`` or ``all-linear``), else PEFT's default
    for the model type, else ``all-linear`` (what ``gradstep train --lora`` places when PEFT
    has no default)."""
    if spec is not None and spec.strip().lower() == ALL_LINEAR:
        return [ALL_LINEAR]
    if spec is not None:
        return [name.strip() for name in spec.split(",") if name.strip()]
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    default = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(config.model_type)
    return list(default) if default is not None else [ALL_LINEAR]
