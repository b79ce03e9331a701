"""Typed configuration of ``gradstep train``: defaults < TOML file < command-line flags.

Every field is validated when a :class:`TrainConfig` is built, so a bad value fails before
any data is loaded, with an error naming the parameter and what it accepts. The CLI builds
its flags from the fields below (help text lives in each field's metadata), so a new field
is one edit here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradstep._validate import check_choice
from gradstep.errors import GradstepError
from gradstep.lr import LR_SCALING
from gradstep.parallel import STRATEGIES
from gradstep.policies import parse_clip, spec_help
from gradstep.precision import PRECISIONS as _PRECISION_DTYPES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "PRECISIONS",
    "RESUME_AUTO",
    "STRATEGIES",
    "ConfigError",
    "TrainConfig",
    "load_toml",
    "resolve",
]

PRECISIONS = tuple(_PRECISION_DTYPES)
DEVICES = ("auto", "cpu", "cuda", "mps")
OPTIMIZERS = ("adamw", "sgd", "lars", "lamb")
LR_SCALINGS = LR_SCALING
RESUME_AUTO = "auto"  # bare `--resume`: the run folder's checkpoints/
AUTO = "auto"  # --micro-batch-size auto


class ConfigError(GradstepError, ValueError):
    """A configuration value or key is invalid; the message names the parameter."""


def _f(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``gradstep train`` needs. Defaults give a ~2 minute CPU demo run."""

    # model
    model: str = _f(
        "gpt",
        "gpt (the demo's byte-level GPT, shaped by --n-layer/--n-head/--d-model) or hf:PATH: "
        "a Hugging Face causal LM built with random init from a local config.json or "
        "save_pretrained folder (never downloaded; vocab_size >= 256)",
    )
    lora: int = _f(0, "with hf:PATH: PEFT LoRA adapters of rank R, base frozen (0: none)")
    aux_loss_coef: float | None = _f(
        None,
        "with hf:PATH of a mixture of experts: turn on its router load-balancing loss with "
        "this coefficient (a mean over micro-batches, gradstep.hf)",
    )
    n_layer: int = _f(4, "transformer blocks")
    n_head: int = _f(4, "attention heads per block")
    d_model: int = _f(160, "model width (divisible by n_head, even head size for RoPE)")
    dropout: float = _f(0.0, "dropout probability in [0, 1)")
    # data
    data: str | None = _f(None, "text file, folder (recursive) or glob; default: stdlib .py")
    seq_len: int = _f(128, "maximum tokens (bytes) per sequence")
    micro_batch_size: int | str = _f(
        8,
        "sequences per micro-batch (what fits in memory), or auto: planned from "
        "--memory-budget (needs --global-batch)",
        type=lambda v: v if v == AUTO else int(v),
    )
    accum_steps: int = _f(4, "micro-batches accumulated into one optimizer step")
    global_batch: int | None = _f(
        None,
        "sequences per optimizer step over all ranks, exact even when not a multiple of the "
        "micro-batch (the last one is shorter); replaces --accum-steps",
    )
    memory_budget: str | None = _f(
        None,
        "memory per device for --micro-batch-size auto and gradstep plan, e.g. 1.5GiB or "
        "800MB (default: the device's free memory)",
    )
    batch_ramp: str | None = _f(
        None,
        "grow the batch during training: START:STEPS (accumulation steps from START to "
        "--accum-steps over STEPS optimizer steps) or gns (double them whenever the measured "
        "noise scale exceeds the batch); the LR schedule then runs in sequences",
    )
    lr_scaling: str = _f(
        "none",
        "rescale the LR to the batch in use, relative to --accum-steps: none, linear (SGD) "
        "or sqrt (Adam)",
        choices=LR_SCALINGS,
    )
    gns: bool = _f(False, "measure the gradient noise scale (gns_b_simple in metrics.jsonl)")
    gns_beta: float = _f(0.99, "EMA decay of the noise-scale estimates, in [0, 1)")
    activation_checkpointing: bool = _f(
        False, "recompute each transformer block in backward instead of keeping activations"
    )
    # the step
    clip: str = _f("norm:1.0", f"gradient clipping, one of: {spec_help()}")
    spike_guard: bool = _f(
        False, "skip the update when the grad norm spikes > 6 sigma (SpikeGuard, before --clip)"
    )
    precision: str = _f("fp32", "compute precision", choices=PRECISIONS)
    strategy: str = _f("none", "data-parallel strategy", choices=STRATEGIES)
    device: str = _f("auto", "auto (cuda if available), cpu, cuda, cuda:N or mps")
    # One thread by default: two spin-waiting OpenMP threads slow down up to 20x as soon as
    # another process shares a 2-core CPU; one thread only loses its share of the CPU.
    threads: int = _f(1, "CPU intra-op threads for torch (0: torch's default, all cores)")
    # optimisation
    optimizer: str = _f(
        "adamw",
        "adamw, sgd (momentum 0.9), lars or lamb (gradstep.optim, exact under FSDP2); biases "
        "and norm gains get no weight decay and no layer adaptation",
        choices=OPTIMIZERS,
    )
    lr: float = _f(3e-3, "peak learning rate (AdamW)")
    min_lr: float = _f(3e-4, "learning rate at the end of the cosine decay")
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices and embeddings")
    warmup: int = _f(20, "linear warmup steps (full-batch steps, with --batch-ramp)")
    max_steps: int = _f(
        150,
        "optimizer steps (windows) to run; with --batch-ramp the run's length in full-batch "
        "steps: it trains on as many sequences, in more, smaller steps",
    )
    seed: int = _f(0, "seed for initialisation, data order and sampling")
    # logging and outputs
    out: str = _f("runs/demo", "run folder for config.json, metrics.jsonl, summary.json")
    eval_every: int = _f(50, "validate every N steps (0: only at start and end)")
    eval_batches: int = _f(20, "validation micro-batches per evaluation")
    log_every: int = _f(10, "progress refresh / plain log line every N steps")
    tensorboard: bool = _f(False, "also write TensorBoard events to OUT/tensorboard")
    sample_tokens: int = _f(200, "bytes to generate for the final sample (0: none)")
    save_every: int = _f(0, "checkpoint to OUT/checkpoints every N steps and at the end (0: never)")
    keep_checkpoints: int = _f(3, "how many of the newest checkpoints to keep")
    resume: str | None = _f(
        None,
        "continue the newest valid checkpoint in DIR: a checkpoints folder, a run folder or "
        "one step-N folder (bare --resume: OUT/checkpoints); finding none is an error",
        nargs="?",
        const=RESUME_AUTO,
    )
    resume_or_start: bool = _f(
        False, "resume from OUT/checkpoints when it holds a valid checkpoint, else start a new run"
    )
    overwrite: bool = _f(False, "start over in an OUT that holds a run, deleting that run first")
    collective_timeout: float = _f(
        600.0, "seconds a rank waits in a collective before the job ends with an error"
    )

    def __post_init__(self) -> None:
        hints = _hints()
        for f in dataclasses.fields(self):
            value = _coerce(f.name, getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)  # frozen: only normalises int -> float
        self._validate()

    def _validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")
        positive = ("n_layer", "n_head", "d_model", "seq_len", "accum_steps")
        for name in (*positive, "max_steps", "eval_batches", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "eval_every", "sample_tokens", "save_every", "threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ConfigError(
                f"d_model must be divisible by n_head with an even head size (for RoPE), got "
                f"d_model={self.d_model}, n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup > self.max_steps:
            raise ConfigError(
                f"warmup must be <= max_steps ({self.max_steps}), got {self.warmup}: the "
                "learning rate would never reach lr"
            )
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be in [0, 2**32), got {self.seed}")
        self._validate_batch()
        self._validate_model()
        if not self.out.strip():
            raise ConfigError("out must name a run folder, got an empty path")
        if not self.collective_timeout > 0:
            raise ConfigError(
                f"collective_timeout must be > 0 seconds, got {self.collective_timeout}"
            )
        if self.resume is not None and self.resume_or_start:
            raise ConfigError("resume and resume_or_start exclude each other; pass one of them")
        if self.overwrite and (self.resume is not None or self.resume_or_start):
            raise ConfigError("overwrite starts a new run: it cannot be combined with resume")
        check_choice("precision", self.precision, PRECISIONS, error=ConfigError)
        check_choice("strategy", self.strategy, STRATEGIES, error=ConfigError)
        check_choice("optimizer", self.optimizer, OPTIMIZERS, error=ConfigError)
        check_choice("lr_scaling", self.lr_scaling, LR_SCALINGS, error=ConfigError)
        if not 0.0 <= self.gns_beta < 1.0:
            raise ConfigError(f"gns_beta must be in [0, 1), got {self.gns_beta}")
        kind, colon, index = self.device.partition(":")
        if kind not in DEVICES or (colon and not (index.isdigit() and kind in ("cuda", "cpu"))):
            raise ConfigError(
                f"device must be one of {', '.join(DEVICES)} or cuda:N, got {self.device!r}"
            )
        try:
            parse_clip(self.clip)
        except ValueError as exc:
            raise ConfigError(f"clip: {exc}") from exc

    def _validate_batch(self) -> None:
        mbs = self.micro_batch_size
        if mbs != AUTO and (isinstance(mbs, str) or mbs < 1):
            raise ConfigError(f"micro_batch_size must be an int >= 1 or 'auto', got {mbs!r}")
        if mbs == AUTO and self.global_batch is None:
            raise ConfigError(
                "micro_batch_size 'auto' needs global_batch (sequences per optimizer step): "
                "the planner chooses how to split it"
            )
        if self.global_batch is not None and self.global_batch < 1:
            raise ConfigError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.batch_ramp is not None:
            self._validate_ramp()
        if self.memory_budget is not None:
            from gradstep.memory import parse_size

            try:
                parse_size(self.memory_budget)
            except ValueError as exc:
                raise ConfigError(f"memory_budget: {exc}") from None

    def _validate_model(self) -> None:
        if self.model != "gpt" and not (self.model.startswith("hf:") and self.model[3:].strip()):
            raise ConfigError(f"model must be gpt or hf:PATH, got {self.model!r}")
        if self.lora < 0:
            raise ConfigError(f"lora must be >= 0 (0: no adapters), got {self.lora}")
        if self.aux_loss_coef is not None and not self.aux_loss_coef >= 0:
            raise ConfigError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        if not self.is_hf:
            for name in ("lora", "aux_loss_coef"):
                if getattr(self, name):
                    raise ConfigError(f"{name} needs model hf:PATH, got model {self.model!r}")
            return
        if self.auto_micro_batch or self.activation_checkpointing:
            what = "micro_batch_size auto" if self.auto_micro_batch else "activation_checkpointing"
            raise ConfigError(f"{what} plans the demo GPT only; it cannot be used with hf:PATH")

    @property
    def is_hf(self) -> bool:
        return self.model.startswith("hf:")

    def _validate_ramp(self) -> None:
        from .schedule import parse_ramp

        try:
            kind, start, _ = parse_ramp(self.batch_ramp)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.global_batch is not None:
            raise ConfigError(
                "batch_ramp grows --accum-steps; it cannot be combined with global_batch"
            )
        if start > self.accum_steps:
            raise ConfigError(
                f"batch_ramp START ({start}) must be <= accum_steps ({self.accum_steps}): the "
                "ramp grows to --accum-steps"
            )
        if kind == "gns" and self.accum_steps < 2:
            raise ConfigError("batch_ramp gns needs accum_steps >= 2: there is nothing to grow")

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
        raise ConfigError(f"{name} must be of type {shown}, got {value!r}")
    return value


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a flat TOML file of TrainConfig keys (``a-b`` is accepted for ``a_b``).

    Keys may also sit under a ``[train]`` table. Unknown keys are an error rather than being
    ignored, so a typo never silently runs with the default.
    """
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(path)!r} is a folder, not a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc
    tables = [("top level", {k: v for k, v in raw.items() if k != "train"})]
    if isinstance(raw.get("train"), dict):
        tables.append(("[train]", raw["train"]))
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for table, items in tables:
        for key, value in items.items():
            name = key.replace("-", "_")
            if name in values:  # max_steps and max-steps, or the same key in two tables
                raise ConfigError(
                    f"{str(path)!r} sets {name} twice ({where[name]} and {table} {key!r}); keep one"
                )
            values[name], where[name] = value, f"{table} {key!r}"
    known = field_names()
    for key in values:
        if key not in known:
            raise ConfigError(
                f"unknown key {key!r} in {str(path)!r}; valid keys: {', '.join(known)}"
            )
    return values


def resolve(config_file: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Defaults, then the TOML file, then ``overrides`` (None values mean "not given")."""
    values = load_toml(config_file) if config_file is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(values) - set(field_names()))
    if unknown:
        raise ConfigError(f"unknown config parameter(s): {', '.join(unknown)}")
    return TrainConfig(**values)
