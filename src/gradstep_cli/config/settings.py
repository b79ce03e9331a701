"""Typed configuration of ``gradstep train``: defaults < TOML file < command-line flags.

Every field is validated when a :class:`TrainConfig` is built, so a bad value fails before
any data is loaded, with an error naming the parameter and what it accepts. The CLI builds
its flags (:mod:`.flags`) and the flag reference (:mod:`.reference`) from the fields below:
help text and section live in each field's metadata, so a new field is one edit here. A
TOML file and overrides are read by :mod:`.loading` (:func:`load_toml`, :func:`resolve`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from gradstep.lr import LR_SCALING
from gradstep.parallel import STRATEGIES, TIMEOUT_RANGE_S
from gradstep.policies import spec_help
from gradstep_cli.config.checks import (
    AUTO,
    GPT_SHAPE,
    INITS,
    LR_MAX,
    OPTIMIZERS,
    PRECISIONS,
    WARMUP_MAX,
    ConfigError,
    flag,
    validate,
)

__all__ = [
    "PRECISIONS",
    "RESUME_AUTO",
    "SECTIONS",
    "STRATEGIES",
    "ConfigError",
    "TrainConfig",
    "field_names",
]

LR_SCALINGS = LR_SCALING
RESUME_AUTO = "auto"  # bare `--resume`: the run folder's checkpoints/
TIMEOUT_RANGE = TIMEOUT_RANGE_S
"""--collective-timeout bounds, in seconds (gradstep.parallel.TIMEOUT_RANGE_S)."""
SECTIONS = {
    "model": "the model: the toy GPT, or a Hugging Face causal LM and its LoRA adapters",
    "data": "the data: training and validation files or records, sequence length",
    "batch": "the batch: micro-batches, accumulation, global batch, memory, ramp, noise scale",
    "optimizer": "the step: optimizer, learning rate, weight decay, clipping, precision",
    "schedule": "the schedule: warm-up, decay, length",
    "parallel": "where it runs: device, threads, ranks and how the model is laid over them",
    "run": "the run: seed, run folder, evaluation, logging, checkpoints, resume",
}
"""Each field's ``section`` (its metadata): the groups of ``--help`` and of the flag
reference, in this order."""


def _f(section: str, default: Any, help: str, **extra: Any) -> Any:
    """A field: its default, the flag's help and its section (a group of ``--help``)."""
    return field(default=default, metadata={"section": section, "help": help, **extra})


def micro_batch_size_arg(value: str) -> int | str:
    """``--micro-batch-size``: a whole number >= 1, or auto (any case, spaces ignored)."""
    text = value.strip()
    if text.lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a whole number >= 1 or auto (planned from --memory-budget), got {value!r}"
        ) from None


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``gradstep train`` needs. Defaults give a ~2 minute CPU demo run."""

    model: str = _f(
        "model",
        "gpt",
        "gpt (the demo's byte-level GPT, shaped by --n-layer/--n-head/--d-model) or hf:PATH: "
        "a Hugging Face causal LM from a save_pretrained folder (its weights when present, "
        "else random init; its tokenizer) or a config.json (random init); never downloaded",
    )
    init: str = _f(
        "model",
        "pretrained",
        "with hf:DIR: pretrained loads DIR's weights when it holds any (else random, with a "
        "note); random always starts from random weights (--seed)",
        choices=INITS,
    )
    tokenizer: str | None = _f(
        "model",
        None,
        "with hf:DIR: tokenizer folder or file (default: DIR's own); the demo GPT reads bytes",
    )
    lora: int = _f("model", 0, "with hf:PATH: PEFT LoRA adapters of rank R, base frozen (0: none)")
    lora_alpha: float | None = _f(
        "model",
        None,
        "LoRA scale numerator: the adapters are scaled by alpha / R",
        default_help="2 x R",
    )
    lora_dropout: float = _f("model", 0.0, "dropout on the LoRA adapters' input, in [0, 1)")
    lora_targets: str | None = _f(
        "model",
        None,
        "modules that get adapters: all-linear (every linear layer but the output head) or "
        "NAME,NAME (module name suffixes)",
        default_help="PEFT's choice for the model type, else all-linear",
    )
    aux_loss_coef: float | None = _f(
        "model",
        None,
        "with hf:PATH of a mixture of experts: turn on its router load-balancing loss with "
        "this coefficient (a mean over micro-batches, gradstep.hf)",
    )
    # None: the demo GPT's GPT_SHAPE; an hf: model's shape is its config.json's (recorded null).
    n_layer: int | None = _f(
        "model", None, "demo GPT: transformer blocks", default_help="4 (not with hf:)"
    )
    n_head: int | None = _f("model", None, "demo GPT: attention heads per block", default_help="4")
    d_model: int | None = _f(
        "model",
        None,
        "demo GPT: model width (divisible by n_head, even head size for RoPE)",
        default_help="160",
    )
    dropout: float = _f(
        "model", 0.0, "dropout probability in [0, 1) of the demo GPT (hf: its config)"
    )
    data: str | None = _f(
        "data",
        None,
        "text file, folder (recursive) or glob, or JSONL of {text}, {prompt, completion} or "
        "{messages} records; default: stdlib .py",
    )
    val_data: str | None = _f(
        "data", None, "validation data, as --data (default: --val-fraction of --data held out)"
    )
    val_fraction: float = _f(
        "data",
        0.1,
        "share of --data held out for validation when --val-data is not given, in (0, 1)",
    )
    skip_bad_records: bool = _f(
        "data", False, "skip (and count) JSONL records that cannot be used instead of stopping"
    )
    seq_len: int = _f("data", 128, "maximum tokens (bytes) per sequence")
    micro_batch_size: int | str = _f(
        "batch",
        8,
        "sequences per micro-batch (what fits in memory), or auto: planned from "
        "--memory-budget (needs --global-batch)",
        type=micro_batch_size_arg,
        type_help="int or `auto`",
    )
    accum_steps: int = _f("batch", 4, "micro-batches accumulated into one optimizer step")
    global_batch: int | None = _f(
        "batch",
        None,
        "sequences per optimizer step over all ranks, exact even when not a multiple of the "
        "micro-batch (the last one is shorter); replaces --accum-steps",
    )
    memory_budget: str | None = _f(
        "batch",
        None,
        "memory per device for --micro-batch-size auto and gradstep plan, e.g. 1.5GiB or "
        "800MB (default: the device's free memory)",
    )
    batch_ramp: str | None = _f(
        "batch",
        None,
        "grow the batch during training: START:STEPS (accumulation steps from START to "
        "--accum-steps over STEPS optimizer steps) or gns (double them whenever the measured "
        "noise scale exceeds the batch); the LR schedule then runs in sequences",
    )
    lr_scaling: str = _f(
        "schedule",
        "none",
        "rescale the LR to the batch in use, relative to --accum-steps: none, linear (SGD) "
        "or sqrt (Adam)",
        choices=LR_SCALINGS,
    )
    gns: bool = _f(
        "batch", False, "measure the gradient noise scale (gns_b_simple in metrics.jsonl)"
    )
    gns_beta: float = _f("batch", 0.99, "EMA decay of the noise-scale estimates, in [0, 1)")
    activation_checkpointing: bool = _f(
        "batch",
        False,
        "recompute each transformer block in backward instead of keeping activations",
    )
    clip: str = _f("optimizer", "norm:1.0", f"gradient clipping, one of: {spec_help()}")
    spike_guard: bool = _f(
        "optimizer",
        False,
        "skip the update when the grad norm spikes > 6 sigma (SpikeGuard, before --clip)",
    )
    precision: str = _f("optimizer", "fp32", "compute precision", choices=PRECISIONS)
    strategy: str = _f("parallel", "none", "data-parallel strategy", choices=STRATEGIES)
    tp: int = _f(
        "parallel",
        1,
        "tensor-parallel ranks, with --strategy fsdp and the demo GPT: each block's attention "
        "(whole heads) and MLP split over N ranks that read the same data, FSDP2 over the "
        "other ranks (a (dp, tp) mesh); N divides the ranks and --n-head",
    )
    hsdp: int = _f(
        "parallel",
        1,
        "HSDP replicas, with --strategy fsdp: parameters sharded within each of R groups of "
        "ranks and copied across them (replicate across nodes, shard within); R divides the "
        "ranks",
    )
    device: str = _f("parallel", "auto", "auto (cuda if available), cpu, cuda, cuda:N or mps")
    # One thread by default: two spin-waiting OpenMP threads slow down up to 20x as soon as
    # another process shares a 2-core CPU; one thread only loses its share of the CPU.
    threads: int = _f(
        "parallel", 1, "CPU intra-op threads for torch (0: torch's default, all cores)"
    )
    optimizer: str = _f(
        "optimizer",
        "adamw",
        "adamw, sgd (momentum 0.9), lars or lamb (gradstep.optim, exact under FSDP2); biases "
        "and norm gains get no weight decay and no layer adaptation",
        choices=OPTIMIZERS,
    )
    lr: float = _f("optimizer", 3e-3, f"peak learning rate (AdamW), in (0, {LR_MAX:g}]")
    min_lr: float | None = _f(
        "schedule", None, "learning rate at the end of the cosine decay", default_help="lr / 10"
    )
    weight_decay: float = _f("optimizer", 0.1, "AdamW weight decay on matrices and embeddings")
    warmup: int | None = _f(
        "schedule",
        None,
        "linear warmup steps (full-batch steps, with --batch-ramp)",
        default_help=f"min({WARMUP_MAX}, max_steps // 5)",
    )
    max_steps: int = _f(
        "schedule",
        150,
        "optimizer steps (windows) to run; with --batch-ramp the run's length in full-batch "
        "steps: it trains on as many sequences, in more, smaller steps",
    )
    seed: int = _f("run", 0, "seed for initialisation, data order and sampling")
    out: str = _f("run", "runs/demo", "run folder for config.json, metrics.jsonl, summary.json")
    eval_every: int = _f("run", 50, "validate every N steps (0: only at start and end)")
    eval_batches: int = _f("run", 20, "validation micro-batches per evaluation")
    log_every: int = _f("run", 10, "progress refresh / plain log line every N steps")
    tensorboard: bool = _f("run", False, "also write TensorBoard events to OUT/tensorboard")
    sample_tokens: int = _f(
        "run", 200, "tokens (bytes for the demo GPT) to generate for the final sample (0: none)"
    )
    save_every: int = _f(
        "run", 0, "checkpoint to OUT/checkpoints every N steps and at the end (0: never)"
    )
    keep_checkpoints: int = _f("run", 3, "how many of the newest checkpoints to keep")
    resume: str | None = _f(
        "run",
        None,
        "continue the newest valid checkpoint in DIR: a checkpoints folder, a run folder or "
        "one step-N folder (bare --resume: OUT/checkpoints); finding none is an error",
        nargs="?",
        const=RESUME_AUTO,
    )
    resume_or_start: bool = _f(
        "run",
        False,
        "resume from OUT/checkpoints when it holds a valid checkpoint, else start a new run",
    )
    overwrite: bool = _f(
        "run", False, "start over in an OUT that holds a run, deleting that run first"
    )
    collective_timeout: float = _f(
        "parallel",
        600.0,
        "seconds a rank waits in a collective before the job ends with an error, in "
        f"[{TIMEOUT_RANGE[0]:g}, {TIMEOUT_RANGE[1]:g}] (7 days)",
    )

    def __post_init__(self) -> None:
        hints = _hints()
        for f in dataclasses.fields(self):
            value = _coerce(f.name, getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)  # frozen: only normalises int -> float
        self._normalise()
        validate(self)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalising in __post_init__ only

    def _normalise(self) -> None:
        """One spelling for what the user may write in any case or with spaces, and the
        automatic defaults (None) resolved to what the run uses (config.json records it)."""
        if isinstance(self.micro_batch_size, str) and self.micro_batch_size.strip().lower() == AUTO:
            self._set("micro_batch_size", AUTO)
        if self.batch_ramp is not None:
            self._set("batch_ramp", "".join(self.batch_ramp.split()).lower())
        self._absolute_paths()
        auto = set()
        if not self.is_hf:  # an hf: model keeps None: its config.json sets the shape
            for name, value in GPT_SHAPE.items():
                if getattr(self, name) is None:
                    self._set(name, value)
                    auto.add(name)
        if self.warmup is None and isinstance(self.max_steps, int):
            # Short runs get a fifth of their length: the default never refuses them.
            self._set("warmup", min(WARMUP_MAX, max(0, self.max_steps // 5)))
            auto.add("warmup")
        if self.min_lr is None and math.isfinite(self.lr):
            # A tenth of lr as the decimal one would type: 3e-3 gives 3e-4, not 3.0000...03e-4.
            self._set("min_lr", float(f"{self.lr / 10:.12g}"))
            auto.add("min_lr")
        self._set("_auto", frozenset(auto))

    def _absolute_paths(self) -> None:
        """The files a run reads, as absolute paths: config.json and the checkpoints then
        name them whatever the working directory of a later resume or export."""
        for name in ("data", "val_data", "tokenizer"):
            value = getattr(self, name)
            if isinstance(value, str) and value.strip():
                self._set(name, os.path.abspath(os.path.expanduser(value)))
        if isinstance(self.model, str) and self.is_hf and self.model[3:].strip():
            self._set("model", "hf:" + os.path.abspath(os.path.expanduser(self.model[3:])))

    @property
    def auto_fields(self) -> frozenset[str]:
        """The fields given as None (automatic) and resolved from the others."""
        return getattr(self, "_auto", frozenset())

    @property
    def is_hf(self) -> bool:
        return self.model.startswith("hf:")

    @property
    def measures_gns(self) -> bool:
        """--gns, or implied by --batch-ramp gns."""
        return self.gns or self.batch_ramp == "gns"

    @property
    def auto_micro_batch(self) -> bool:
        return self.micro_batch_size == AUTO

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _coerce(name: str, value: Any, hint: Any) -> Any:
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


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def __getattr__(name: str) -> Any:
    """``load_toml`` and ``resolve`` (:mod:`.loading`) are importable from here too; looked
    up when first asked for, as :mod:`.loading` imports this module."""
    if name in ("load_toml", "resolve"):
        from gradstep_cli.config import loading

        return getattr(loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
