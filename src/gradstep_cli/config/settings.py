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
import os
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
    coerce,
    validate,
)
from gradstep_cli.config.data_fields import DataFields, is_hub_name
from gradstep_cli.config.evaluation import EVAL_METRICS, normal_report_to
from gradstep_cli.config.launching import LaunchFields
from gradstep_cli.config.recipe import RecipeFields

__all__ = [
    "LR_MAX",
    "OPTIMIZERS",
    "PRECISIONS",
    "RESUME_AUTO",
    "SECTIONS",
    "STRATEGIES",
    "ConfigError",
    "TrainConfig",
    "WARMUP_MAX",
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
class TrainConfig(RecipeFields, LaunchFields, DataFields):
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
    loss_chunk_tokens: int = _f(
        "model",
        1024,
        "compute the loss's output projection and cross-entropy (training and evaluation) this "
        "many tokens at a time, so no step holds the whole (tokens x vocab) logits (0: the "
        "whole logits at once); a LoRA-adapted or soft-capped head falls back to the whole "
        "logits, with a note",
    )
    compile: bool = _f(
        "model",
        False,
        "torch.compile each transformer block for training (fixed shapes: --packing for "
        "records of varied lengths; evaluation runs eagerly); the first step's compile time "
        "is reported (summary.json: compile_seconds)",
    )
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
    seed: int = _f("run", 0, "seed for initialisation, data order and sampling")
    out: str = _f("run", "runs/demo", "run folder for config.json, metrics.jsonl, summary.json")
    eval_every: int = _f("run", 50, "validate every N steps (0: only at start and end)")
    eval_batches: int | None = _f(
        "run", None, "score a fixed sample of N validation micro-batches, its size said, "
        "instead of the whole validation set", default_help="the whole set",
    )  # fmt: skip
    keep_best: str | None = _f(
        "run", None, "also keep the best evaluation's checkpoint by METRIC, never pruned "
        "(gradstep export RUN --best)", choices=EVAL_METRICS,
    )  # fmt: skip
    early_stopping_patience: int = _f(
        "run", 0, "stop after N evaluations without improving the --keep-best metric (0: never)"
    )
    log_every: int = _f("run", 10, "progress refresh / plain log line every N steps")
    tensorboard: bool = _f("run", False, "also write TensorBoard events to OUT/tensorboard")
    report_to: str | None = _f(
        "run", None, "trackers besides metrics.jsonl, comma-separated: tensorboard, wandb, "
        "mlflow (pip install 'gradstep[wandb]' / '[mlflow]'), or none",
    )  # fmt: skip
    sample_tokens: int = _f(
        "run", 200, "tokens (bytes for the demo GPT) to generate for the final sample and per "
        "--sample-prompts sample (0: none)",
    )  # fmt: skip
    sample_every: int = _f(
        "run", 0, "sample --sample-prompts every N steps (0: at the start and end only)"
    )
    sample_prompts: str | None = _f(
        "run", None, "prompts for greedy samples into OUT/samples.jsonl: text (one per line) or "
        "JSONL of strings, {prompt} or {messages} (chat template)",
    )  # fmt: skip
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
            value = coerce(f.name, getattr(self, f.name), hints[f.name])
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
        if isinstance(self.report_to, str):
            self._set("report_to", normal_report_to(self.report_to))
        self._absolute_paths()
        auto = set()
        if not self.is_hf:  # an hf: model keeps None: its config.json sets the shape
            for name, value in GPT_SHAPE.items():
                if getattr(self, name) is None:
                    self._set(name, value)
                    auto.add(name)
        auto |= self._resolve_recipe(self._set)  # the defaults that fit the model
        self._set("_auto", frozenset(auto))

    def _absolute_paths(self) -> None:
        """The files a run reads, as absolute paths: config.json and the checkpoints then
        name them whatever the working directory of a later resume or export."""
        for name in ("data", "val_data", "tokenizer", "sample_prompts"):
            value = getattr(self, name)
            hub = name in ("data", "val_data") and isinstance(value, str) and is_hub_name(value)
            if isinstance(value, str) and value.strip() and not hub:
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


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def __getattr__(name: str) -> Any:
    """``load_toml`` and ``resolve`` (:mod:`.loading`) are importable from here too; looked
    up when first asked for, as :mod:`.loading` imports this module."""
    if name in ("load_toml", "resolve"):
        from gradstep_cli.config import loading

        return getattr(loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
