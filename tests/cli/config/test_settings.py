"""``TrainConfig`` (gradstep_cli.config.settings): its defaults, the automatic ones resolved,
what a user may write in any case, and field types."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradstep_cli.cli import build_parser, main
from gradstep_cli.config.settings import ConfigError, TrainConfig, resolve


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.toml"
    path.write_text(text)
    return path


def test_defaults_are_valid() -> None:
    cfg = TrainConfig()
    assert (cfg.micro_batch_size, cfg.accum_steps, cfg.clip) == (8, 4, "norm:1.0")
    assert cfg.precision == "fp32" and cfg.strategy == "none" and cfg.resume is None


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


def test_bad_toml_value_names_the_parameter(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="precision"):
        resolve(write(tmp_path, 'precision = "fp64"\n'))


@given(st.integers(1, 10_000))
def test_the_default_warmup_fits_every_run_length(max_steps: int) -> None:
    """hf-client-2 friction 6: `--max-steps 3` was refused on the default --warmup 20."""
    cfg = TrainConfig(max_steps=max_steps)
    assert 0 <= cfg.warmup <= max_steps
    assert cfg.warmup == (20 if max_steps >= 100 else max_steps // 5)
    assert "warmup" in cfg.auto_fields
    assert TrainConfig(max_steps=max_steps, warmup=0).warmup == 0  # given: kept as given


def test_the_defaults_of_the_demo_run_are_unchanged() -> None:
    """`make train` keeps warmup 20 and min_lr 3e-4, bit for bit (the LR of every step)."""
    cfg = TrainConfig()
    assert (cfg.warmup, cfg.min_lr, cfg.min_lr / cfg.lr) == (20, 3e-4, 3e-4 / 3e-3)
    assert (cfg.n_layer, cfg.n_head, cfg.d_model) == (4, 4, 160)
    with pytest.raises(ConfigError, match=r"--warmup must be <= --max-steps \(3\), got 20"):
        TrainConfig(max_steps=3, warmup=20)  # an explicit warm-up stays checked


def test_min_lr_follows_lr_unless_given(capsys) -> None:
    """N47: `--optimizer lamb --lr 1e-30` was refused about --min-lr, never given."""
    assert TrainConfig(optimizer="lamb", lr=1e-30).min_lr == 1e-31
    assert TrainConfig(lr=0.5).min_lr == 0.05
    with pytest.raises(ConfigError, match=r"--min-lr must be in \[0, --lr 0.001\], got 0.01"):
        TrainConfig(lr=1e-3, min_lr=1e-2)


@pytest.mark.parametrize("spelling", ["auto", "AUTO", " Auto ", "aUtO"])
def test_micro_batch_size_auto_in_any_case(spelling: str, tmp_path: Path) -> None:
    """N18: `--micro-batch-size AUTO` gave argparse's `invalid <lambda> value`."""
    args = build_parser().parse_args(["train", "--micro-batch-size", spelling])
    assert args.micro_batch_size == "auto"
    toml = tmp_path / "c.toml"
    toml.write_text(f'micro_batch_size = "{spelling}"\nglobal_batch = 8\n')
    assert resolve(toml).micro_batch_size == "auto"


def test_a_bad_micro_batch_size_lists_what_is_accepted(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--micro-batch-size", "lots"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "<lambda>" not in err
    assert "--micro-batch-size: must be a whole number >= 1 or auto" in err, err


@pytest.mark.parametrize(("spelling", "kept"), [(" 1:3", "1:3"), ("GNS", "gns"), ("1 : 3 ", "1:3")])
def test_batch_ramp_tolerates_case_and_spaces(spelling: str, kept: str) -> None:
    """N30: --clip tolerated case and spaces, --batch-ramp did not."""
    assert TrainConfig(batch_ramp=spelling).batch_ramp == kept  # config.json records `kept`
