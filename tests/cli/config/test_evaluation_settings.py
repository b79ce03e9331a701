"""The evaluation, best-checkpoint, sample and tracker settings (config/evaluation.py):
their refusals name the flag and what fits; --report-to is normalised."""

from __future__ import annotations

import pytest

from gradstep_cli.config.evaluation import trackers_of
from gradstep_cli.config.settings import ConfigError, TrainConfig


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"early_stopping_patience": 2}, "pass --keep-best val_loss"),
        ({"early_stopping_patience": 2, "keep_best": "val_loss", "eval_every": 0}, "--eval-every"),
        ({"keep_best": "loss"}, "--keep-best must be one of val_loss, val_accuracy"),
        ({"eval_batches": 0}, "leave it out to score the whole validation set"),
        ({"sample_every": 5}, "--sample-prompts FILE"),
        ({"sample_prompts": "p.txt", "sample_tokens": 0}, "--sample-tokens N > 0"),
        ({"report_to": "wandb,neptune"}, "unknown tracker 'neptune'"),
        ({"report_to": "none,wandb"}, "none means no tracker"),
        ({"early_stopping_patience": -1}, "--early-stopping-patience must be >= 0"),
    ],
)
def test_refused(settings: dict, said: str) -> None:
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**settings)


def test_report_to_is_normalised_and_tensorboard_joins_it() -> None:
    cfg = TrainConfig(report_to=" WandB, mlflow ,wandb", tensorboard=True)
    assert cfg.report_to == "wandb,mlflow"
    assert trackers_of(cfg.report_to, cfg.tensorboard) == ("tensorboard", "wandb", "mlflow")
    assert TrainConfig(report_to="none").report_to == "none"
    assert trackers_of("none") == ()
    assert TrainConfig().eval_batches is None  # the whole validation set


def test_sample_prompts_is_recorded_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(sample_prompts="p.txt", sample_every=3)
    assert cfg.sample_prompts == str(tmp_path / "p.txt")
