"""``--lora``: PEFT LoRA adapters on the run's Hugging Face model, the base frozen.

Targets are PEFT's default for the model type where it has one, else ``all-linear`` (PEFT's
own expansion, applied to the bare ``PreTrainedModel`` so the output head is left out), or
the ``--lora-targets`` the user names: module name suffixes, or 3-D expert weights (sent to
PEFT's ``target_parameters``). The resolved targets and the scale are printed once.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from gradstep_cli.config.preflight import note
from gradstep_cli.config.settings import ConfigError, TrainConfig

__all__ = ["ALL_LINEAR", "adapted", "add_lora"]

ALL_LINEAR = "all-linear"


# PEFT's own warnings about its internals (transformers' deprecated property it reads; the
# v4-to-v5 MoE renaming of its all-linear rank pattern): nothing the user can act on.
_PEFT_NOISE = (
    (".*is_gradient_checkpointing.*", FutureWarning),
    (".*(rank|alpha)_pattern keys did not match.*", RuntimeWarning),
)


def add_lora(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """``model`` (a bare ``PreTrainedModel``) with PEFT LoRA adapters as ``cfg`` asks
    (``--lora``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-targets``), base frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("lora needs peft: pip install 'gradstep[hf]'") from None
    modules, parameters, source = _targets(model, cfg.lora_targets)
    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora
    lora = LoraConfig(
        r=cfg.lora,
        lora_alpha=alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=modules,
        target_parameters=parameters,
    )
    try:
        with warnings.catch_warnings():
            for message, category in _PEFT_NOISE:
                warnings.filterwarnings("ignore", message=message, category=category)
            wrapped = get_peft_model(model, lora)
    except ValueError as exc:
        raise ConfigError(_peft_refusal(exc, cfg)) from None
    scale = f"{alpha / cfg.lora:g}"
    note(
        f"LoRA rank {cfg.lora}, alpha {alpha:g} (scale alpha/rank = {scale}), dropout "
        f"{cfg.lora_dropout:g}: adapters on {', '.join(adapted(wrapped))} ({source})"
    )
    return wrapped


def _targets(model: nn.Module, spec: str | None) -> tuple[Any, list[str] | None, str]:
    """(target_modules, target_parameters, where they come from) for PEFT."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if spec is None:
        default = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
        if default is not None:
            return list(default), None, f"PEFT's default for {model_type}"
        return ALL_LINEAR, None, f"all-linear: PEFT has no default for {model_type}"
    if spec.strip().lower() == ALL_LINEAR:
        return ALL_LINEAR, None, "--lora-targets all-linear"
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"--lora-targets must be all-linear or NAME,NAME, got {spec!r}")
    modules = [n for n in names if _matches(n, (m for m, _ in model.named_modules()))]
    parameters = [n for n in names if n not in modules and _matches(n, _expert_params(model))]
    unknown = [n for n in names if n not in modules and n not in parameters]
    if unknown:
        raise ConfigError(
            f"--lora-targets: {', '.join(unknown)} matches no module of this {model_type} "
            f"model; {_target_names(model)} (or pass all-linear)"
        )
    return modules, parameters or None, "--lora-targets"


def _matches(name: str, full_names: Any) -> bool:
    """PEFT's rule: a target is a full name or a suffix after a dot."""
    return any(full == name or full.endswith("." + name) for full in full_names)


def _expert_params(model: nn.Module) -> list[str]:
    """Parameters PEFT can adapt directly (target_parameters): 3-D expert weights."""
    return [name for name, p in model.named_parameters() if p.dim() == 3]


def _target_names(model: nn.Module) -> str:
    """What NAMEs the model offers: its linear layers (not the head) and expert weights."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
              if isinstance(m, nn.Linear) and m is not head}  # fmt: skip
    experts = {name.rsplit(".", 1)[-1] for name in _expert_params(model)}
    text = f"its linear layers are {', '.join(sorted(linear))}"
    return text + (f", its expert weights {', '.join(sorted(experts))}" if experts else "")


def adapted(model: nn.Module) -> list[str]:
    """The short names of what got LoRA adapters in a PEFT model (modules and parameters)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    names = set()
    for name, module in model.named_modules():
        # A parameter's wrappers nest (experts.base_layer): name it by its owning module.
        short = name.replace(".base_layer", "").rsplit(".", 1)[-1]
        if isinstance(module, ParamWrapper):
            names.add(f"{short}.{module.parameter_name}")
        elif isinstance(module, LoraLayer):
            names.add(short)
    return sorted(names)


def _peft_refusal(exc: ValueError, cfg: TrainConfig) -> str:
    """PEFT's ValueError as the flags the user can change."""
    text = str(exc).split("\n")[0]
    if "lora_dropout" in text:
        return (
            f"--lora-dropout {cfg.lora_dropout:g}: PEFT cannot apply dropout to adapters on "
            "expert weights (3-D parameters, which all-linear adapts on this model): pass "
            "--lora-dropout 0, or --lora-targets with linear layers only"
        )
    return f"--lora-targets: PEFT cannot place adapters in this model ({text})"
