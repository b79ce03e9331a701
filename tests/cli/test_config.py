"""TrainConfig: TOML loading, precedence of flags, and errors that name the parameter."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gradstep_cli.cli import main
from gradstep_cli.config.settings import ConfigError, TrainConfig, load_toml, resolve


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.toml"
    path.write_text(text)
    return path


def test_defaults_are_valid() -> None:
    cfg = TrainConfig()
    assert (cfg.micro_batch_size, cfg.accum_steps, cfg.clip) == (8, 4, "norm:1.0")
    assert cfg.precision == "fp32" and cfg.strategy == "none" and cfg.resume is None


def test_toml_then_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'lr = 1\naccum_steps = 2\nmicro-batch-size = 3\nclip = "value:0.5"\ndata = "x.txt"\n',
    )
    cfg = resolve(path, accum_steps=5, clip=None)  # None means "flag not given"
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # int accepted for a float field
    assert cfg.accum_steps == 5  # the override wins
    assert cfg.micro_batch_size == 3  # dashes are accepted
    assert cfg.clip == "value:0.5" and cfg.data == os.path.abspath("x.txt")


def test_the_files_a_run_reads_are_recorded_absolute(tmp_path: Path, monkeypatch) -> None:
    """A resume or an export from another working directory must find the same files."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = TrainConfig(model="hf:models/m", data="d/*.txt", val_data="v.jsonl", tokenizer="~/t")
    assert cfg.model == f"hf:{tmp_path}/models/m"
    assert cfg.data == f"{tmp_path}/d/*.txt" and cfg.val_data == f"{tmp_path}/v.jsonl"
    assert cfg.tokenizer == f"{tmp_path}/home/t"
    assert TrainConfig(**cfg.to_dict()) == cfg  # a round trip through config.json is stable
    assert TrainConfig().data is None and TrainConfig().model == "gpt"


def test_train_table_is_accepted(tmp_path: Path) -> None:
    assert load_toml(write(tmp_path, "[train]\nmax_steps = 7\n")) == {"max_steps": 7}


def test_unknown_toml_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'learning_rate'"):
        resolve(write(tmp_path, "learning_rate = 0.1\n"))


def test_missing_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(write(tmp_path, "lr = = 3\n"))


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"precision": "fp8"}, "--precision must be one of fp32, bf16, fp16"),
        ({"strategy": "zero"}, "--strategy must be one of none, ddp, fsdp"),
        ({"clip": "bogus"}, "clip"),
        ({"clip": "norm:-1"}, "clip"),
        ({"lr": 0.0}, "lr"),
        ({"lr": "fast"}, "--lr must be of type float"),
        ({"accum_steps": 0}, "--accum-steps"),
        ({"micro_batch_size": True}, "--micro-batch-size"),
        ({"n_head": 7}, "--n-head"),
        ({"dropout": 1.0}, "dropout"),
        ({"min_lr": 1.0}, "--min-lr"),
        ({"warmup": -1}, "warmup"),
        ({"device": "tpu"}, "device"),
        ({"threads": -1}, "threads"),
    ],
)
def test_bad_values_name_the_parameter(values: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        TrainConfig(**values)


def test_bad_toml_value_names_the_parameter(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="precision"):
        resolve(write(tmp_path, 'precision = "fp64"\n'))


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--clip", "bogus", "--out", str(tmp_path)]) == 2
    assert "clip" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse rejects choices itself
        main(["train", "--precision", "fp8"])
    assert exc.value.code == 2
    assert "precision" in capsys.readouterr().err
