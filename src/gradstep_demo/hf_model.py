"""``gradstep train --model hf:PATH``: a Hugging Face causal LM as the demo's model.

The model is built from a config alone (a ``config.json`` or a ``save_pretrained`` folder),
randomly initialised from ``--seed``, never downloaded. ``--lora R`` wraps it in PEFT LoRA
adapters (PEFT's default attention projections for the model type; the base is frozen),
and ``--aux-loss-coef`` turns on a mixture-of-experts model's router loss. The byte-level
corpus stays: the model's vocabulary must hold the 256 byte values.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradstep import LossSum, parallel
from gradstep.hf import causal_lm_loss, count_tokens

from .config import ConfigError, TrainConfig
from .data import Batch
from .model import GPT, GPTConfig

__all__ = ["HFLoss", "LogitsOnly", "build_model", "count_batch", "hf_config", "load_tokenizer"]

HF_PREFIX = "hf:"
BYTE_VOCAB = 256


def build_model(cfg: TrainConfig) -> nn.Module:
    """The run's model on the CPU: the demo GPT, or the HF model ``cfg.model`` names."""
    if not cfg.is_hf:
        return GPT(
            GPTConfig(
                n_layer=cfg.n_layer,
                n_head=cfg.n_head,
                d_model=cfg.d_model,
                max_seq_len=cfg.seq_len,
                dropout=cfg.dropout,
            )
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(cfg))
    return _with_lora(model, cfg.lora) if cfg.lora else model


def load_tokenizer(cfg: TrainConfig) -> Any:
    """The run's tokenizer: None for the demo GPT (bytes)."""
    return None


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model 'hf:PATH' needs transformers (and peft for --lora): pip install 'gradstep[hf]'"
        ) from None
    return transformers


def hf_config(cfg: TrainConfig) -> Any:
    """The HF config from ``hf:PATH``, checked against the run and adjusted for training."""
    transformers = _transformers()
    path = Path(cfg.model[len(HF_PREFIX) :]).expanduser()
    if not (path.is_file() or (path / "config.json").is_file()):
        raise ConfigError(
            f"model {cfg.model!r}: {str(path)!r} is neither a config.json file nor a folder "
            "holding one (save_pretrained); nothing is ever downloaded"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model {cfg.model!r}: not a usable HF config ({exc})") from None
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < BYTE_VOCAB:
        raise ConfigError(
            f"model {cfg.model!r}: vocab_size must be >= {BYTE_VOCAB} (the demo's byte-level "
            f"tokens), got {vocab}"
        )
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if isinstance(positions, int) and positions < cfg.seq_len:
        raise ConfigError(
            f"model {cfg.model!r} holds {positions} positions, fewer than seq_len="
            f"{cfg.seq_len}; pass --seq-len {positions} or less"
        )
    if cfg.aux_loss_coef is not None:
        if not hasattr(config, "router_aux_loss_coef"):
            raise ConfigError(
                f"aux_loss_coef: model {cfg.model!r} ({config.model_type}) has no router loss "
                "(no router_aux_loss_coef in its config): it is not a mixture of experts"
            )
        config.output_router_logits = True
        config.router_aux_loss_coef = cfg.aux_loss_coef
    for line in _notes(cfg, path, config):
        _note(line)
    config.use_cache = False  # training: no KV cache built in every forward
    return config


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _notes(cfg: TrainConfig, path: Path, config: Any) -> list[str]:
    """What the run silently does differently from what the model folder suggests."""
    notes = []
    folder = path if path.is_dir() else path.parent
    weights = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if weights:
        notes.append(
            f"model {cfg.model!r}: {weights[0]} is not loaded; hf:PATH builds the model from "
            f"its config with random weights (--seed {cfg.seed})"
        )
    routed = hasattr(config, "router_aux_loss_coef")
    if routed and cfg.aux_loss_coef is None and not getattr(config, "output_router_logits", False):
        notes.append(
            f"model {cfg.model!r} is a mixture of experts whose config has "
            "output_router_logits false: its router load-balancing loss is off; pass "
            f"--aux-loss-coef COEF (the config's is {config.router_aux_loss_coef}) to turn it on"
        )
    return notes


def _note(line: str) -> None:
    """A line for the user on stderr, from rank 0 only (as train's other notes)."""
    if parallel.is_main():
        print(line, file=sys.stderr)


def _with_lora(model: nn.Module, r: int) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("lora needs peft: pip install 'gradstep[hf]'") from None
    try:
        with warnings.catch_warnings():
            # PEFT reads transformers' deprecated `is_gradient_checkpointing`: its warning is
            # about PEFT's code, nothing the user can act on.
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
            )
            # target_modules=None: PEFT's own choice for the model type, its attention
            # projections.
            return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0))
    except ValueError as exc:
        raise ConfigError(f"lora: PEFT cannot place adapters in this model ({exc})") from None


def count_batch(batch: Batch) -> int:
    """``count=`` of the demo's batches: their labels are already shifted."""
    return count_tokens(batch, shifted=True)


@dataclass(frozen=True)
class HFLoss:
    """``loss_fn`` for an HF model on the demo's batches (pre-shifted labels, right padding:
    no attention mask is needed for a causal model): :func:`gradstep.hf.causal_lm_loss`."""

    device: torch.device

    def __call__(self, model: nn.Module, batch: Batch) -> LossSum:
        moved = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return causal_lm_loss(model, moved, shifted=True)


class LogitsOnly(nn.Module):
    """``model(ids) -> logits`` for the demo's sampler, around an HF model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits
