"""The checks every :class:`~gradstep_cli.config.settings.TrainConfig` passes when it is built.

Each failure is one :class:`ConfigError` naming the command-line flag (``--warmup``, not the
field ``warmup``: the CLI and its TOML file are how users meet these settings) and what it
accepts, so a bad value fails before any data is loaded or any rank waits for another.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from gradstep.errors import GradstepError
from gradstep.lr import LR_SCALING
from gradstep.parallel import STRATEGIES, TIMEOUT_RANGE_S
from gradstep.policies import parse_clip
from gradstep_cli.config.evaluation import check_evaluation

# gradstep_cli.config.settings.TrainConfig, which calls validate() when it is built: named here
# without importing it back.
TrainConfig = Any

__all__ = [
    "AUTO",
    "DEVICES",
    "GPT_SHAPE",
    "INITS",
    "LR_MAX",
    "OPTIMIZERS",
    "PRECISIONS",
    "WARMUP_MAX",
    "ConfigError",
    "coerce",
    "flag",
    "validate",
]

PRECISIONS = ("fp32", "bf16", "fp16")
"""``Stepper(precision=...)``'s names (tests/cli/test_boundary.py keeps them equal)."""
DEVICES = ("auto", "cpu", "cuda", "mps")
OPTIMIZERS = ("adamw", "sgd", "lars", "lamb")
AUTO = "auto"  # --micro-batch-size auto
GPT_SHAPE = {"n_layer": 4, "n_head": 4, "d_model": 160}
"""The demo GPT's shape when --n-layer/--n-head/--d-model are not given (not with hf:)."""
LR_MAX = 1e6
"""Largest --lr accepted: far above any useful rate (the reviewers' diverging LARS 1e6 and
SGD 1e3 runs still run and report their divergence), and far enough below float32's 3.4e38
that the optimizers' scalar arithmetic (AdamW's lr / bias correction, up to 10x) stays finite."""
WARMUP_MAX = 20
"""Auto warm-up: 20 steps, or a fifth of --max-steps for runs shorter than 100 steps."""

_AT_LEAST_ONE = (
    "seq_len", "accum_steps", "log_every", "keep_checkpoints", "tp", "hsdp",
)  # fmt: skip
_AT_LEAST_ZERO = ("eval_every", "sample_tokens", "save_every", "threads", "loss_chunk_tokens")
INITS = ("pretrained", "random")
_CHOICES = {
    "init": INITS,
    "precision": PRECISIONS,
    "strategy": STRATEGIES,
    "optimizer": OPTIMIZERS,
    "lr_scaling": LR_SCALING,
}


class ConfigError(GradstepError, ValueError):
    """A configuration value or key is invalid; the message names the flag."""


def flag(name: str) -> str:
    """The command-line flag of field ``name`` (``micro_batch_size`` -> ``--micro-batch-size``)."""
    return "--" + name.replace("_", "-")


def validate(cfg: TrainConfig) -> None:
    """Raise ConfigError for the first setting of ``cfg`` out of its range."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag(f.name)} must be a finite number, got {value}")
    shape = () if cfg.is_hf else tuple(GPT_SHAPE)  # hf: None, refused if given
    for name in (*shape, *_AT_LEAST_ONE):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{flag(name)} must be >= 1, got {getattr(cfg, name)}")
    for name in _AT_LEAST_ZERO:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{flag(name)} must be >= 0, got {getattr(cfg, name)}")
    if shape and (cfg.d_model % cfg.n_head or (cfg.d_model // cfg.n_head) % 2):
        raise ConfigError(
            "--d-model must be divisible by --n-head with an even head size (for RoPE), got "
            f"--d-model {cfg.d_model}, --n-head {cfg.n_head}"
        )
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    _schedule(cfg)
    if not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"--seed must be in [0, 2**32), got {cfg.seed}")
    _batch(cfg)
    _data(cfg)
    _model(cfg)
    _run(cfg)
    for name, allowed in _CHOICES.items():
        _choice(name, getattr(cfg, name), allowed)
    _mesh(cfg)
    check_evaluation(cfg)
    from gradstep_cli.config.launching import check_launch  # it imports this module

    check_launch(cfg)
    if not 0.0 <= cfg.gns_beta < 1.0:
        raise ConfigError(f"--gns-beta must be in [0, 1), got {cfg.gns_beta}")
    kind, colon, index = cfg.device.partition(":")
    if kind not in DEVICES or (colon and not (index.isdigit() and kind in ("cuda", "cpu"))):
        raise ConfigError(
            f"--device must be one of {', '.join(DEVICES)} or cuda:N, got {cfg.device!r}"
        )
    try:
        parse_clip(cfg.clip)
    except ValueError as exc:
        raise ConfigError(f"--clip: {exc}") from exc


def coerce(name: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against the field type; accept an int where a float is expected."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = [a for a in typing.get_args(hint)] if union else [hint]
    if value is None and type(None) in kinds:
        return None
    kinds = [k for k in kinds if k is not type(None)]
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and bool not in kinds:
        value = object()  # True is an int to Python, not to a config file
    if not any(isinstance(value, k) for k in kinds):
        shown = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{flag(name)} must be of type {shown}, got {value!r}")
    return value


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{flag(name)} must be one of {', '.join(allowed)}; got {value!r}")


def _schedule(cfg: TrainConfig) -> None:
    """The learning rate, its schedule and the run's length (gradstep_cli.config.recipe)."""
    if not 0 < cfg.lr <= LR_MAX:
        why = (
            "a larger rate is far beyond any optimizer's useful range and overflows its "
            "float32 arithmetic"
            if cfg.lr > 0
            else "a learning rate is positive"
        )
        raise ConfigError(f"--lr must be in (0, {LR_MAX:g}], got {cfg.lr:g}: {why}")
    if cfg.lr_schedule == "constant" and cfg.min_lr != cfg.lr:
        raise ConfigError(
            f"--min-lr {cfg.min_lr:g} is where a decay ends: --lr-schedule constant has none "
            "(drop --min-lr, or choose cosine, linear or wsd)"
        )
    if not 0.0 <= cfg.min_lr <= cfg.lr:
        raise ConfigError(f"--min-lr must be in [0, --lr {cfg.lr:g}], got {cfg.min_lr:g}")
    if cfg.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    _length(cfg)
    if cfg.decay_ratio is not None and cfg.lr_schedule != "wsd":
        raise ConfigError(
            f"--decay-ratio sets the decay of --lr-schedule wsd, not of {cfg.lr_schedule}"
        )
    if cfg.decay_ratio is not None and not 0.0 < cfg.decay_ratio <= 1.0:
        raise ConfigError(f"--decay-ratio must be in (0, 1], got {cfg.decay_ratio:g}")
    if cfg.max_steps is not None:
        from gradstep_cli.run.schedule import shape_of

        try:
            shape_of(cfg, cfg.max_steps)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    _optimizer(cfg)


def _length(cfg: TrainConfig) -> None:
    """--max-steps or --epochs, --stop-after, and --warmup's two forms."""
    for name in ("max_steps", "stop_after"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"{flag(name)} must be >= 1, got {value}")
    if cfg.epochs is not None and not cfg.epochs > 0:
        raise ConfigError(f"--epochs must be > 0, got {cfg.epochs:g}")
    warmup = cfg.warmup
    if warmup is not None and (warmup < 0 or (isinstance(warmup, float) and warmup >= 1)):
        raise ConfigError(
            f"--warmup must be whole steps (>= 0) or a share of the run in (0, 1), got {warmup}"
        )


def _optimizer(cfg: TrainConfig) -> None:
    """--lr-schedule, --adam-betas and --adam-eps in range (given to an optimizer without
    moments: refused with the settings given, gradstep_cli.config.recipe.adam_refusal)."""
    from gradstep_cli.config.recipe import SCHEDULES, betas_of

    _choice("lr_schedule", cfg.lr_schedule, SCHEDULES)
    if cfg.adam_betas is not None:
        betas_of(cfg.adam_betas)
    if cfg.adam_eps is not None and not cfg.adam_eps > 0:
        raise ConfigError(f"--adam-eps must be > 0, got {cfg.adam_eps:g}")


def _run(cfg: TrainConfig) -> None:
    """Where the run goes, how it resumes, how long a collective may wait."""
    if not cfg.out.strip():
        raise ConfigError("--out must name a run folder, got an empty path")
    low, high = TIMEOUT_RANGE_S
    if not low <= cfg.collective_timeout <= high:
        raise ConfigError(
            f"--collective-timeout must be in [{low:g}, {high:g}] seconds (1 s to 7 days), "
            f"got {cfg.collective_timeout:g}"
        )
    if cfg.resume is not None and cfg.resume_or_start:
        raise ConfigError("--resume and --resume-or-start exclude each other; pass one of them")
    if cfg.overwrite and (cfg.resume is not None or cfg.resume_or_start):
        which = "--resume-or-start" if cfg.resume_or_start else "--resume"
        raise ConfigError(
            f"--overwrite starts a new run: it cannot be combined with {which}; pass one"
        )


def _batch(cfg: TrainConfig) -> None:
    mbs = cfg.micro_batch_size
    if mbs != AUTO and (isinstance(mbs, str) or mbs < 1):
        raise ConfigError(f"--micro-batch-size must be a whole number >= 1 or auto, got {mbs!r}")
    if mbs == AUTO and cfg.global_batch is None:
        raise ConfigError(
            "--micro-batch-size auto needs --global-batch (sequences per optimizer step): "
            "the planner chooses how to split it"
        )
    if cfg.global_batch is not None and cfg.global_batch < 1:
        raise ConfigError(f"--global-batch must be >= 1, got {cfg.global_batch}")
    if cfg.batch_ramp is not None:
        _ramp(cfg)
    if cfg.memory_budget is not None:
        from gradstep.memory import parse_size

        try:
            parse_size(cfg.memory_budget)
        except ValueError as exc:
            raise ConfigError(f"--memory-budget: {exc}") from None


def _model(cfg: TrainConfig) -> None:
    if cfg.model != "gpt" and not (cfg.model.startswith("hf:") and cfg.model[3:].strip()):
        raise ConfigError(f"--model must be gpt or hf:PATH, got {cfg.model!r}")
    if cfg.lora < 0:
        raise ConfigError(f"--lora must be >= 0 (0: no adapters), got {cfg.lora}")
    if cfg.aux_loss_coef is not None and not cfg.aux_loss_coef >= 0:
        raise ConfigError(f"--aux-loss-coef must be >= 0, got {cfg.aux_loss_coef}")
    if cfg.lora_alpha is not None and not cfg.lora_alpha > 0:
        raise ConfigError(f"--lora-alpha must be > 0, got {cfg.lora_alpha}")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    if not cfg.lora:
        for name in ("lora_alpha", "lora_targets"):
            if getattr(cfg, name) is not None:
                raise ConfigError(f"{flag(name)} shapes LoRA adapters: it needs --lora R")
        if cfg.lora_dropout:
            raise ConfigError("--lora-dropout shapes LoRA adapters: it needs --lora R")
    if not cfg.is_hf:
        hf_only = {"lora": cfg.lora, "aux_loss_coef": cfg.aux_loss_coef, "tokenizer": cfg.tokenizer}
        hf_only["init"] = cfg.init if cfg.init != "pretrained" else None
        for name, value in hf_only.items():
            if value:
                raise ConfigError(f"{flag(name)} needs --model hf:PATH, got --model {cfg.model}")
        return
    shaped = [flag(name) for name in GPT_SHAPE if getattr(cfg, name) is not None]
    if shaped:
        raise ConfigError(
            f"{', '.join(shaped)} shape the demo GPT only; with --model {cfg.model} the "
            "model's config.json sets its shape: drop these flags"
        )
    if cfg.dropout:
        raise ConfigError(
            f"--dropout is the demo GPT's; with --model {cfg.model} the model's config.json "
            "sets its dropout (e.g. attention_dropout): drop --dropout, or edit the config "
            "(for adapters: --lora-dropout)"
        )


def _mesh(cfg: TrainConfig) -> None:
    """--tp and --hsdp: FSDP2 on a 2-D mesh, or both on a 3-D one (replicate x shard x tp);
    tensor parallel splits the default GPT's heads. The number of ranks they must divide is
    checked at launch (preflight)."""
    for name in ("tp", "hsdp"):
        value = getattr(cfg, name)
        if value > 1 and cfg.strategy != "fsdp":
            raise ConfigError(
                f"{flag(name)} {value} needs --strategy fsdp (FSDP2 on a 2-D mesh), got "
                f"--strategy {cfg.strategy}"
            )
    if cfg.tp == 1:
        return
    if cfg.is_hf:
        raise ConfigError(
            f"--tp {cfg.tp} needs --model gpt: the CLI has a tensor-parallel plan for its own "
            f"GPT only, not for --model {cfg.model}; use --hsdp or plain --strategy fsdp"
        )
    if cfg.n_head % cfg.tp:
        fits = [n for n in range(1, cfg.n_head + 1) if cfg.n_head % n == 0]
        raise ConfigError(
            f"--tp {cfg.tp} must divide --n-head ({cfg.n_head}): each tensor-parallel rank "
            f"holds whole heads; use --tp {' or '.join(map(str, fits))}"
        )
    if cfg.dropout:
        raise ConfigError(
            f"--dropout {cfg.dropout:g} with --tp {cfg.tp} is not supported: tensor-parallel "
            "ranks would need the same dropout masks on their shared activations and their "
            "own on their heads; drop --dropout (0) or --tp"
        )


def _data(cfg: TrainConfig) -> None:
    from gradstep_cli.config.data_fields import check_data  # it imports this module

    check_data(cfg)


def _ramp(cfg: TrainConfig) -> None:
    from gradstep_cli.run.schedule import parse_ramp

    try:
        kind, start, _ = parse_ramp(cfg.batch_ramp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.global_batch is not None:
        raise ConfigError(
            "--batch-ramp grows --accum-steps; it cannot be combined with --global-batch"
        )
    if start > cfg.accum_steps:
        raise ConfigError(
            f"--batch-ramp START ({start}) must be <= --accum-steps ({cfg.accum_steps}): "
            "the ramp grows to --accum-steps"
        )
    if kind == "gns" and cfg.accum_steps < 2:
        raise ConfigError("--batch-ramp gns needs --accum-steps >= 2: there is nothing to grow")
