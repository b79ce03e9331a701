"""The settings of a run's evaluations, best checkpoint, samples and trackers, checked.

``--keep-best METRIC`` names a key of an evaluation's ``metrics.jsonl`` row
(:data:`EVAL_METRICS`: whether lower or higher is better); ``--early-stopping-patience N``
watches that same metric, so it needs ``--keep-best`` (the stopped run's best checkpoint is
the one to use) and evaluations to count (``--eval-every N``). ``--sample-every N`` samples
``--sample-prompts`` (so needs them), each at most ``--sample-tokens`` tokens long.
``--report-to`` is a comma-separated list of :data:`gradstep.trackers.TRACKERS`, or none.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EVAL_METRICS",
    "TRACKERS",
    "check_evaluation",
    "check_prompt_file",
    "check_trackers",
    "normal_report_to",
    "trackers_of",
]

EVAL_METRICS = {"val_loss": "min", "val_accuracy": "max"}
"""``--keep-best`` METRIC: the evaluation's metrics.jsonl key, and which way is better."""
TRACKERS = ("tensorboard", "wandb", "mlflow")
"""``--report-to``: gradstep.trackers.TRACKERS (not imported: the config stays light)."""


def normal_report_to(value: str) -> str:
    """``--report-to`` as recorded: lower case, spaces dropped, each name once (``none``
    when empty)."""
    names = dict.fromkeys(n.strip().lower() for n in value.split(",") if n.strip())
    return ",".join(names) or "none"


def trackers_of(value: str, tensorboard: bool = False) -> tuple[str, ...]:
    """``--report-to``'s names in order, once each, lower case (``none``: no tracker);
    ``tensorboard`` adds TensorBoard (the older ``--tensorboard`` flag)."""
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    names = [n for n in dict.fromkeys(names) if n != "none"]
    if tensorboard and "tensorboard" not in names:
        names.insert(0, "tensorboard")
    return tuple(names)


def _error(message: str) -> Exception:
    from gradstep_cli.config.checks import ConfigError  # it imports this module

    return ConfigError(message)


def check_evaluation(cfg: Any) -> None:
    """Raise ConfigError for evaluation, best-checkpoint, sample and tracker settings that
    are out of range or do not fit together."""
    if cfg.eval_batches is not None and cfg.eval_batches < 1:
        raise _error(
            f"--eval-batches must be >= 1 (leave it out to score the whole validation set), "
            f"got {cfg.eval_batches}"
        )
    for name in ("early_stopping_patience", "sample_every"):
        if getattr(cfg, name) < 0:
            raise _error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if cfg.keep_best is not None and cfg.keep_best not in EVAL_METRICS:
        raise _error(f"--keep-best must be one of {', '.join(EVAL_METRICS)}; got {cfg.keep_best!r}")
    if cfg.early_stopping_patience:
        if cfg.keep_best is None:
            raise _error(
                f"--early-stopping-patience {cfg.early_stopping_patience} watches the --keep-best "
                "metric and leaves its best checkpoint: pass --keep-best val_loss (or "
                "val_accuracy) too"
            )
        if not cfg.eval_every:
            raise _error(
                f"--early-stopping-patience {cfg.early_stopping_patience} counts evaluations, "
                "and --eval-every 0 evaluates only at the start and the end: pass --eval-every N"
            )
    _samples(cfg)
    _report_to(cfg.report_to)


def _samples(cfg: Any) -> None:
    if cfg.sample_every and cfg.sample_prompts is None:
        raise _error(
            f"--sample-every {cfg.sample_every} samples the prompts of --sample-prompts FILE: "
            "pass it too"
        )
    if cfg.sample_prompts is not None and not cfg.sample_prompts.strip():
        raise _error("--sample-prompts must name a file, got an empty path")
    if cfg.sample_prompts is not None and not cfg.sample_tokens:
        raise _error(
            "--sample-prompts needs --sample-tokens N > 0: the most tokens each sample generates"
        )


def _report_to(value: str | None) -> None:
    if value is None:
        return
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in (*TRACKERS, "none")]
    if unknown:
        raise _error(
            f"--report-to: unknown tracker {unknown[0]!r}; give a comma-separated list of "
            f"{', '.join(TRACKERS)}, or none"
        )
    if "none" in names and len(set(names)) > 1:
        raise _error(f"--report-to {value!r}: none means no tracker; drop it or the others")


def check_trackers(cfg: Any) -> None:
    """Refuse a --report-to tracker whose package is not installed (before the run starts:
    the run's files are not yet written)."""
    import importlib

    packages = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
    for name in trackers_of(cfg.report_to or "", cfg.tensorboard):
        try:
            importlib.import_module(packages[name])
        except ImportError:
            flag = "--tensorboard" if name == "tensorboard" and cfg.tensorboard else "--report-to"
            raise _error(
                f"{flag} {name}: the {name} package is not installed (gradstep does not "
                f"need it otherwise): pip install 'gradstep[{name}]'"
            ) from None


def check_prompt_file(cfg: Any) -> None:
    """Refuse a --sample-prompts file that cannot be read or parsed (before the run starts;
    its chat messages are rendered, and checked, once the tokenizer is loaded)."""
    if cfg.sample_prompts is not None:
        from gradstep_cli.run.samples import prompt_entries  # it imports the model code

        prompt_entries(cfg.sample_prompts)
