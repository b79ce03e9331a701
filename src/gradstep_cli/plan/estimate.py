"""The run in the terms of the library's memory model: the shape of the run's model, the
memory of its optimizer, its dtypes and sharding (``gradstep.memory.estimate_step_memory``'s
arguments), from its flags. The one place the command line's names meet the library's: the
library knows no ``--optimizer`` and no ``TrainConfig``."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import torch

from gradstep.memory import (
    OptimizerMemory,
    Shape,
    TransformerShape,
    chunks_loss,
    from_hf_config,
    lora_targets,
)
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.models.gpt import GPTConfig
from gradstep_cli.models.parallel_plan import layout_of
from gradstep_cli.models.spec import ModelSpec

__all__ = [
    "estimate_kwargs",
    "gpt_shape",
    "head_chunks",
    "loss_chunks",
    "model_shape",
    "optimizer_memory",
    "quiet",
    "quiet_hf_config",
    "shape_of",
]

_COMPUTE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_shape(model: ModelSpec, width: int | None = None) -> Shape:
    """The analytic model's shape of the run's model for rows of ``width`` (default
    ``--seq-len``): the toy GPT's, or the HF model's from its config, with LoRA."""
    cfg, config = model.cfg, model.config
    seq_len = width or cfg.seq_len
    if not cfg.is_hf:
        return gpt_shape(config, seq_len)
    return from_hf_config(
        config,
        seq_len,
        lora_rank=cfg.lora,
        lora_targets=lora_targets(config, cfg.lora_targets) if cfg.lora else (),
        lora_dropout=cfg.lora_dropout,
    )


def shape_of(cfg: TrainConfig, width: int | None = None) -> Shape:
    """:func:`model_shape` of ``cfg``'s model, for a caller without the model stage (an hf:
    model's config is read here)."""
    return model_shape(ModelSpec.of(cfg, quiet_hf_config(cfg) if cfg.is_hf else None), width)


def gpt_shape(gpt: GPTConfig, seq_len: int | None = None) -> TransformerShape:
    """The analytic model's shape of the toy GPT ``gpt`` (rows of ``seq_len``, default its
    ``max_seq_len``)."""
    return TransformerShape(
        n_layer=gpt.n_layer,
        d_model=gpt.d_model,
        n_head=gpt.n_head,
        vocab_size=gpt.vocab_size,
        seq_len=seq_len or gpt.max_seq_len,
        d_ff=gpt.mlp_ratio * gpt.d_model,
        tied_embeddings=gpt.tie_weights,
    )


def optimizer_memory(cfg: TrainConfig) -> OptimizerMemory:
    """What the run's optimizer (``--optimizer``, as ``train.build_optimizer`` builds it)
    keeps per parameter and holds in its step, for the analytic model."""
    from gradstep_cli.run.components import build_optimizer

    # Over a stand-in parameter: the model needs the optimizer's kind and settings
    # (momentum, AMSGrad), not the run's parameters.
    return OptimizerMemory.of(build_optimizer(torch.nn.Linear(1, 1), cfg))


def estimate_kwargs(cfg: TrainConfig, device: torch.device, world: int) -> dict:
    """What the analytic model needs besides the shape: precision, sharding (over ``world``
    launched ranks; ``--tp``/``--hsdp``: the 2-D mesh), optimizer,
    dropout (on CPU with dropout torch's attention takes the math path: s^2 matrices), the
    chunked loss (``--loss-chunk-tokens``: one chunk's logits, not the whole), packed rows
    (``--packing``: the block-causal mask every attention layer keeps), and
    for an HF model the dtype of its frozen base (LoRA; ``hf_model.param_dtype``)."""
    out = {
        "compute_dtype": _COMPUTE[cfg.precision],
        "world_size": world,
        "sharded": cfg.strategy == "fsdp",
        "layout": layout_of(cfg),
        "optimizer": optimizer_memory(cfg),
        "dropout": cfg.dropout,
        "attention": "math" if cfg.dropout > 0 and device.type == "cpu" else "fused",
        "loss_chunk_tokens": cfg.loss_chunk_tokens,
        "packed": cfg.packing,
    }
    if cfg.is_hf:
        from gradstep_cli.models.hf import param_dtype

        out.update(dropout=0.0, attention="fused", frozen_dtype=param_dtype(cfg))
    return out


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The probe's own copy of the model says nothing: its notes (weights loaded, LoRA
    targets, ...) are the run's, said when the run builds it."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def quiet_hf_config(cfg: TrainConfig) -> Any:
    """The HF config as the run adjusts it (router loss, no KV cache), said nothing about."""
    from gradstep_cli.models.hf import hf_config

    with quiet():
        return hf_config(cfg)


def head_chunks(model: ModelSpec) -> bool:
    """Whether the run's loss can leave out the whole logits (``gradstep.hf.chunkable`` from
    the config alone): the demo GPT's always; an HF model's unless a softcap or a scale
    follows its projection or LoRA adapts it (the memory model's rule,
    ``hf_activations.chunks_loss``)."""
    config = model.hf_config
    if config is None:
        return True
    after = ("final_logit_softcapping", "logit_scale")
    if any(getattr(config, name, None) is not None for name in after):
        return False
    return chunks_loss(model_shape(model), 1)


def loss_chunks(
    cfg: TrainConfig, model: ModelSpec, given: frozenset[str] | None
) -> list[int] | None:
    """The ``--loss-chunk-tokens`` settings to choose from: the run's own (the default when
    it is 0: a resumed run's 0 may be an earlier plan's choice) and the whole logits; None
    (not planned) when the flag was given, or the head cannot be chunked
    (:func:`head_chunks`)."""
    default = TrainConfig().loss_chunk_tokens
    if given is None:  # what differs from its default was set on purpose
        given = frozenset({"loss_chunk_tokens"} if cfg.loss_chunk_tokens != default else ())
    if "loss_chunk_tokens" in given or not head_chunks(model):
        return None
    return [cfg.loss_chunk_tokens or default, 0]
