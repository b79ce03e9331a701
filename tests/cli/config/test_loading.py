"""TOML files of settings (gradstep_cli.config.loading): precedence, the ``[train]`` table,
and errors that name the file and the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gradstep_cli.cli import main
from gradstep_cli.config.settings import ConfigError, load_toml, resolve


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.toml"
    path.write_text(text)
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


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
    ("case", "content", "needle"),
    [
        ("41 a folder", None, "is a folder"),
        ("42 not UTF-8", b"\xff\xfe", "not UTF-8"),
        ("43 key spelled twice", b"max_steps = 3\nmax-steps = 4\n", "sets max_steps twice"),
        ("44 top level and [train]", b"max-steps = 3\n[train]\nmax-steps = 5\n", "twice"),
    ],
)
def test_bad_config_files(tmp_path, capsys, case, content, needle):
    path = tmp_path / "cfg.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    code, err = run(capsys, "train", "--config", str(path), "--out", str(tmp_path / "r"))
    assert code == 2 and needle in err, (case, err)
