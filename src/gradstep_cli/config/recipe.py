"""The step's recipe: optimizer, learning rate and its schedule, and how long a run is, with
defaults that fit the model.

:class:`RecipeFields` holds the settings of the ``optimizer`` and ``schedule`` sections;
:class:`~gradstep_cli.config.settings.TrainConfig` inherits them. A setting left out
(``None``) takes its value from the set of defaults that fits the model (:data:`RECIPES`),
resolved when the config is built so that ``config.json`` records what runs:

* ``pretraining``: the toy GPT, or an ``hf:`` model from random weights (``--init random``
  or a folder without weights): lr 3e-3, AdamW betas (0.9, 0.95), weight decay 0.1, cosine
  to lr / 10 after a warm-up of min(20, max_steps // 5) steps;
* ``fine-tuning``: an ``hf:`` model's pretrained weights, trained in full: TRL's
  ``SFTConfig`` defaults (lr 2e-5; transformers' ``TrainingArguments``: linear decay to 0,
  no warm-up, weight decay 0, betas (0.9, 0.999), eps 1e-8, gradient norm clipped at 1);
* ``fine-tuning with LoRA``: the same, at lr 2e-4 (TRL's PEFT guide: about ten times the
  full fine-tuning rate for adapters).

Flags (and config-file keys) always win; a resume runs the checkpoint's values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradstep.lr import LR_SCALING
from gradstep_cli.config.checks import LR_MAX, OPTIMIZERS, WARMUP_MAX, ConfigError

__all__ = [
    "ADAM_OPTIMIZERS",
    "RECIPES",
    "SCHEDULES",
    "RecipeFields",
    "adam_refusal",
    "betas_of",
    "recipe_note",
    "warmup_arg",
]

SCHEDULES = ("cosine", "linear", "constant", "wsd")
"""--lr-schedule (gradstep_cli.run.schedule.LRShape's kinds)."""
ADAM_OPTIMIZERS = ("adamw", "lamb")
"""The optimizers --adam-betas and --adam-eps set."""
DEFAULT_STEPS = 150
"""--max-steps when neither it nor --epochs is given."""
DEFAULT_DECAY_RATIO = 0.2
"""--lr-schedule wsd: the share of the horizon its decay takes, unless --decay-ratio says."""

RECIPES: dict[str, dict[str, Any]] = {
    "pretraining": {
        "lr": 3e-3, "weight_decay": 0.1, "lr_schedule": "cosine", "min_lr": "lr / 10",
        "warmup": "min(20, max_steps // 5)", "adam_betas": "0.9,0.95", "adam_eps": 1e-8,
    },
    "fine-tuning": {
        "lr": 2e-5, "weight_decay": 0.0, "lr_schedule": "linear", "min_lr": 0.0,
        "warmup": 0, "adam_betas": "0.9,0.999", "adam_eps": 1e-8,
    },
    "fine-tuning with LoRA": {
        "lr": 2e-4, "weight_decay": 0.0, "lr_schedule": "linear", "min_lr": 0.0,
        "warmup": 0, "adam_betas": "0.9,0.999", "adam_eps": 1e-8,
    },
}  # fmt: skip
"""The sets of defaults, by name; strings are rules (resolved by :func:`_resolve`)."""
LAMB = {"adam_betas": "0.9,0.999", "adam_eps": 1e-6}
"""LAMB's own betas and epsilon (the paper's), whatever the set."""
WHY = {
    "pretraining": "the toy GPT or random weights",
    "fine-tuning": "a pretrained model, TRL's SFT defaults",
    "fine-tuning with LoRA": "a pretrained model with LoRA, TRL's SFT defaults at 10x lr",
}


def _f(section: str, default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"section": section, "help": help, **extra})


def warmup_arg(value: str) -> int | float:
    """``--warmup``: steps (a whole number) or a share of the run (a number in (0, 1))."""
    import argparse

    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be whole steps or a share of the run in (0, 1), got {value!r}"
        ) from None
    return int(number) if number.is_integer() and number >= 1 or number == 0 else number


@dataclass(frozen=True)
class RecipeFields:
    """The ``optimizer`` and ``schedule`` sections of ``TrainConfig``."""

    optimizer: str = _f(
        "optimizer", "adamw", "adamw (torch), sgd (momentum 0.9), lars or lamb (gradstep.optim, "
        "exact under FSDP2); biases and norm gains get no weight decay and no layer adaptation",
        choices=OPTIMIZERS,
    )  # fmt: skip
    lr: float | None = _f(
        "optimizer", None, f"peak learning rate, in (0, {LR_MAX:g}]",
        default_help="3e-3; 2e-5 for pretrained hf: weights, 2e-4 with --lora",
    )  # fmt: skip
    weight_decay: float | None = _f(
        "optimizer", None, "decoupled weight decay of matrices and embeddings",
        default_help="0.1; 0 for pretrained hf: weights",
    )  # fmt: skip
    adam_betas: str | None = _f(
        "optimizer", None, "B1,B2: AdamW's (and LAMB's) moment decays, each in [0, 1)",
        default_help="0.9,0.95; 0.9,0.999 for pretrained hf: weights and lamb",
    )  # fmt: skip
    adam_eps: float | None = _f(
        "optimizer", None, "AdamW's (and LAMB's) epsilon, > 0", default_help="1e-8; lamb 1e-6"
    )
    max_steps: int | None = _f(
        "schedule", None, "the run's length in optimizer steps: the LR schedule's horizon "
        "(with --batch-ramp, in full-batch steps: as many sequences, in more, smaller steps)",
        default_help=f"{DEFAULT_STEPS}, or from --epochs",
    )  # fmt: skip
    epochs: float | None = _f(
        "schedule", None, "the run's length in passes over the training data instead of "
        "--max-steps (fractions allowed): the steps are derived and printed",
    )  # fmt: skip
    stop_after: int | None = _f(
        "schedule", None, "stop this invocation after N optimizer steps without changing the "
        "schedule (a smoke run of a long schedule; a later resume continues it)",
    )  # fmt: skip
    lr_schedule: str | None = _f(
        "schedule", None, "after the warm-up: cosine or linear decay to --min-lr, constant, or "
        "wsd (stable, then a cosine decay over the last --decay-ratio of the run)",
        choices=SCHEDULES, default_help="cosine; linear for pretrained hf: weights",
    )  # fmt: skip
    warmup: int | float | None = _f(
        "schedule", None, "linear warm-up from 0 (wsd: from --min-lr): whole steps, or a share "
        "of --max-steps in (0, 1) (full-batch steps with --batch-ramp)", type=warmup_arg,
        type_help="int or float", default_help=f"min({WARMUP_MAX}, max_steps // 5); 0 for "
        "pretrained hf: weights",
    )  # fmt: skip
    decay_ratio: float | None = _f(
        "schedule", None, "--lr-schedule wsd: the share of --max-steps its decay takes, in "
        "(0, 1]", default_help=f"{DEFAULT_DECAY_RATIO} with wsd",
    )  # fmt: skip
    min_lr: float | None = _f(
        "schedule", None, "where the decay ends, in [0, --lr]",
        default_help="lr / 10; 0 for pretrained hf: weights",
    )  # fmt: skip
    lr_scaling: str = _f(
        "schedule", "none", "rescale the LR to the batch in use, relative to --accum-steps: "
        "none, linear (SGD) or sqrt (Adam)", choices=LR_SCALING,
    )  # fmt: skip

    @property
    def betas(self) -> tuple[float, float] | None:
        return None if self.adam_betas is None else betas_of(self.adam_betas)

    def _resolve_recipe(self, set_: Any) -> set[str]:
        """Resolve the settings left out from the set of defaults that fits the model;
        ``set_(name, value)`` writes a field. Returns the names resolved."""
        recipe = self.recipe
        auto = set()

        def default(name: str, value: Any) -> None:
            if getattr(self, name) is None and value is not None:
                set_(name, value)
                auto.add(name)

        if isinstance(self.warmup, float) and self.warmup >= 1 and self.warmup.is_integer():
            set_("warmup", int(self.warmup))  # 8.0 from a config file's 8 (int -> float)
        for name in ("lr", "weight_decay", "lr_schedule"):
            default(name, RECIPES[recipe][name])
        if self.max_steps is None:  # pending --epochs: derived once the data is read
            default("max_steps", DEFAULT_STEPS if self.epochs is None else None)
            auto.add("max_steps")
        default("warmup", _warmup(recipe, self.max_steps))
        default("min_lr", _min_lr(recipe, self.lr, self.lr_schedule))
        default("decay_ratio", DEFAULT_DECAY_RATIO if self.lr_schedule == "wsd" else None)
        if self.optimizer in ADAM_OPTIMIZERS:
            own = LAMB if self.optimizer == "lamb" else RECIPES[recipe]
            default("adam_betas", own["adam_betas"])
            default("adam_eps", own["adam_eps"])
        else:  # SGD and LARS have none: recorded as null (given, see adam_refusal)
            for name in ("adam_betas", "adam_eps"):
                set_(name, None)
                auto.add(name)
        if isinstance(self.adam_betas, str):
            set_("adam_betas", ",".join(repr(b) for b in betas_of(self.adam_betas)))
        return auto

    @property
    def recipe(self) -> str:
        """The set of defaults that fits the model (:data:`RECIPES`)."""
        if not _pretrained_weights(self):
            return "pretraining"
        return "fine-tuning with LoRA" if getattr(self, "lora", 0) else "fine-tuning"


def _warmup(recipe: str, max_steps: int | None) -> int | None:
    if recipe != "pretraining":
        return RECIPES[recipe]["warmup"]
    # Short runs get a fifth of their length: the default never refuses them.
    return None if max_steps is None else min(WARMUP_MAX, max(0, max_steps // 5))


def _min_lr(recipe: str, lr: float | None, schedule: str | None) -> float | None:
    if lr is None or not math.isfinite(lr):
        return None
    if schedule == "constant":
        return lr  # no decay: where it "ends" is lr itself
    if recipe != "pretraining":
        return RECIPES[recipe]["min_lr"]
    # A tenth of lr as the decimal one would type: 3e-3 gives 3e-4, not 3.0000...03e-4.
    return float(f"{lr / 10:.12g}")


def _pretrained_weights(cfg: Any) -> bool:
    """An ``hf:`` folder whose weights the run loads (``--init pretrained``)."""
    model = getattr(cfg, "model", "")
    if not (isinstance(model, str) and model.startswith("hf:")):
        return False
    if getattr(cfg, "init", "pretrained") != "pretrained":
        return False
    from gradstep_cli.models.hf import WEIGHT_FILES  # it imports the config

    path = Path(model[3:]).expanduser()
    return path.is_dir() and any((path / name).is_file() for name in WEIGHT_FILES)


def adam_refusal(cfg: Any, given: frozenset[str]) -> str | None:
    """Why --adam-betas / --adam-eps, given, do nothing with ``cfg.optimizer`` (None: they
    do, or were not given)."""
    named = sorted(given & {"adam_betas", "adam_eps"})
    if not named or cfg.optimizer in ADAM_OPTIMIZERS:
        return None
    flags = " and ".join("--" + n.replace("_", "-") for n in named)
    return f"{flags} set AdamW's and LAMB's moments; --optimizer {cfg.optimizer} has none"


def betas_of(text: str) -> tuple[float, float]:
    """``"B1,B2"`` -> ``(B1, B2)``, each in [0, 1); ConfigError otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        b1, b2 = (float(p) for p in parts)
    except ValueError:
        b1 = b2 = math.nan
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ConfigError(
            f"--adam-betas must be B1,B2 with each in [0, 1) (e.g. 0.9,0.999), got {text!r}"
        )
    return b1, b2


def recipe_note(cfg: Any) -> str:
    """The line that says which set of defaults applied, and what it set."""
    auto = cfg.auto_fields
    said = []
    if "lr" in auto:
        said.append(f"lr {cfg.lr:g}")
    if "lr_schedule" in auto or "min_lr" in auto:
        said.append(f"{cfg.lr_schedule} schedule to min-lr {cfg.min_lr:g}")
    if "warmup" in auto:
        said.append(f"warm-up {cfg.warmup}" if cfg.warmup else "no warm-up")
    elif cfg.warmup is None:  # pending --epochs: the steps follow once the data is read
        said.append(f"warm-up {RECIPES[cfg.recipe]['warmup']}")
    if "weight_decay" in auto:
        said.append(f"weight decay {cfg.weight_decay:g}")
    if "adam_betas" in auto and cfg.adam_betas is not None:  # SGD, LARS: none
        said.append(f"betas {cfg.adam_betas}")
    if "adam_eps" in auto and cfg.adam_eps is not None:
        said.append(f"eps {cfg.adam_eps:g}")
    what = ", ".join(said) if said else "none left to set: every one was given"
    return f"{cfg.recipe} defaults ({WHY[cfg.recipe]}): {what}"
