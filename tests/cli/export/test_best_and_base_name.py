"""`gradstep export --best` and `--base-name` (gradstep_cli.export.run): which checkpoint
--best names, and the refusals of both flags, without training a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradstep_cli.config.checks import ConfigError
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.export.run import _best_step, _check_base_name


def test_best_reads_best_json_of_the_run_or_its_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    best = {"metric": "val_loss", "value": 1.5, "step": 40, "checkpoint": "step-000040"}
    (tmp_path / "checkpoints" / "best.json").write_text(json.dumps(best))
    assert _best_step(tmp_path, None) == 40
    assert _best_step(tmp_path / "checkpoints", None) == 40
    with pytest.raises(ConfigError, match="--best exports the best checkpoint; --step 3"):
        _best_step(tmp_path, 3)


def test_best_without_keep_best_says_how_to_get_one(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="train with --keep-best METRIC"):
        _best_step(tmp_path, None)


def test_base_name_is_for_adapters_only(tmp_path: Path) -> None:
    lora = TrainConfig(model=f"hf:{tmp_path}", lora=4)
    _check_base_name(lora, False, "org/base-model")  # an adapter: fine
    _check_base_name(lora, False, None)
    with pytest.raises(ConfigError, match="writes the merged model"):
        _check_base_name(lora, True, "org/base-model")
    with pytest.raises(ConfigError, match="the whole model"):
        _check_base_name(TrainConfig(model=f"hf:{tmp_path}"), False, "base")
    with pytest.raises(ConfigError, match="must name the base model"):
        _check_base_name(lora, False, " ")
