"""What every ``TrainConfig`` passes when it is built (gradstep_cli.config.checks): each
refusal names the flag and what it accepts."""

from __future__ import annotations

import re

import pytest
import torch

from gradstep_cli.cli import main
from gradstep_cli.config.settings import (
    GPT_SHAPE,
    LR_MAX,
    OPTIMIZERS,
    TIMEOUT_RANGE,
    ConfigError,
    TrainConfig,
)
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.train import build_optimizer
from tests.integration.cli.test_lr_runs import TINY
from tests.support.batches import text_corpus


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(text_corpus(tmp_path_factory.mktemp("settings") / "corpus"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


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


def test_an_absurd_lr_is_refused_with_the_range(data, tmp_path, capsys) -> None:
    """N49: `--lr 1e300` passed the finiteness check and crashed inside AdamW."""
    code, err = run(capsys, "train", *TINY, "--data", data, "--out", str(tmp_path / "r"),
                    "--lr", "1e300")  # fmt: skip
    assert code == 2 and "--lr must be in (0, 1e+06]" in err, err
    assert not (tmp_path / "r").exists()
    TrainConfig(optimizer="lars", lr=1e6)  # the reviewers' diverging runs stay allowed
    TrainConfig(optimizer="sgd", lr=1e3)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_largest_lr_keeps_every_optimizers_arithmetic_finite(optimizer: str) -> None:
    """The bound's reason: one real step at lr = LR_MAX raises nothing in any optimizer."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=8))
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer, lr=LR_MAX))
    ids = torch.randint(0, 256, (2, 8))
    model(ids).logsumexp(-1).mean().backward()
    opt.step()  # AdamW: lr / bias correction = 10 x LR_MAX, far below float32's range


@pytest.mark.parametrize("seconds", [1e-9, 0.5, 7 * 86400 + 1, 1e308])
def test_the_collective_timeout_has_a_sane_range(seconds: float) -> None:
    """N81-N83: 1e308 overflowed a C int under torchrun, 1e-9 gave a C++ stack."""
    with pytest.raises(ConfigError, match=r"--collective-timeout must be in \[1, 604800\]"):
        TrainConfig(collective_timeout=seconds)
    for ok in TIMEOUT_RANGE:
        assert TrainConfig(collective_timeout=ok).collective_timeout == ok


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"micro_batch_size": "auto"}, "--micro-batch-size auto needs --global-batch"),  # N16
        ({"global_batch": 0}, "--global-batch must be >= 1"),  # N13
        ({"gns_beta": 1.0}, "--gns-beta must be in [0, 1)"),  # N39
        ({"gns_beta": -0.1}, "--gns-beta must be in [0, 1)"),  # N40
        ({"collective_timeout": 0.0}, "--collective-timeout must be in"),  # N76
        ({"micro_batch_size": 0}, "--micro-batch-size must be a whole number >= 1 or auto"),
        ({"batch_ramp": "0:5"}, "--batch-ramp must be START:STEPS"),
        ({"batch_ramp": "1:3", "global_batch": 8}, "cannot be combined with --global-batch"),
        ({"resume_or_start": True, "overwrite": True}, "combined with --resume-or-start"),  # N136
        ({"resume": "auto", "overwrite": True}, "combined with --resume;"),
    ],
)
def test_config_errors_name_the_flag(values: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        TrainConfig(**values)
    assert needle in str(exc.value)


def test_gpt_shape_flags_are_refused_with_an_hf_model(tmp_path, capsys) -> None:
    """N64/N65: ignored with hf: (yet recorded in config.json), or refused for RoPE."""
    for flags in (["--n-layer", "7"], ["--d-model", "30", "--n-head", "4"]):
        code, err = run(capsys, "train", "--model", f"hf:{tmp_path}", *flags,
                        "--out", str(tmp_path / "r"))  # fmt: skip
        assert code == 2 and "shape the demo GPT only" in err and flags[0] in err, err
        assert "RoPE" not in err
    assert not (tmp_path / "r").exists()
    hf = TrainConfig(model=f"hf:{tmp_path}")
    assert [hf.to_dict()[name] for name in GPT_SHAPE] == [None, None, None]


def test_dropout_is_refused_with_an_hf_model(tmp_path, capsys) -> None:
    """--dropout with hf: changed nothing (the model's config sets its dropout) yet was
    recorded in config.json (outside re-check of N64's neighbours)."""
    code, err = run(capsys, "train", "--model", f"hf:{tmp_path}", "--dropout", "0.1",
                    "--out", str(tmp_path / "r"))  # fmt: skip
    assert code == 2 and "--dropout is the demo GPT's" in err and "config.json" in err, err
    assert not (tmp_path / "r").exists()
    code, err = run(capsys, "plan", "--model", f"hf:{tmp_path}", "--dropout", "0.1",
                    "--global-batch", "8", "--memory-budget", "4GiB")  # fmt: skip
    assert code == 2 and "--dropout is the demo GPT's" in err, err


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tp": 2, "strategy": "ddp"}, "--tp 2 needs --strategy fsdp (FSDP2 on a 2-D mesh), "
         "got --strategy ddp"),
        ({"hsdp": 2}, "--hsdp 2 needs --strategy fsdp (FSDP2 on a 2-D mesh), got --strategy none"),
        ({"tp": 0}, "--tp must be >= 1, got 0"),
        ({"hsdp": -1}, "--hsdp must be >= 1, got -1"),
        ({"tp": 3, "strategy": "fsdp"}, "--tp 3 must divide --n-head (4): each tensor-parallel "
         "rank holds whole heads; use --tp 1 or 2 or 4"),
        ({"tp": 2, "strategy": "fsdp", "dropout": 0.1}, "--dropout 0.1 with --tp 2 is not "
         "supported"),
        ({"tp": 2, "strategy": "fsdp", "model": "hf:/x"}, "--tp 2 needs --model gpt"),
    ],
)  # fmt: skip
def test_mesh_flags_are_refused_naming_the_flag(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(**settings)


def test_tp_and_hsdp_together_are_the_3d_mesh_and_its_ranks_are_checked() -> None:
    """--hsdp R --tp N: replicate x shard x tp (issue 29); the product must divide the
    launched ranks, said before anything is built."""
    from gradstep.parallel import Layout
    from gradstep_cli.config.preflight import _check_mesh
    from gradstep_cli.models.parallel_plan import layout_of

    cfg = TrainConfig(tp=2, hsdp=2, strategy="fsdp")
    assert layout_of(cfg) == Layout(dp_replicate=2, tp=2)
    assert layout_of(cfg).resolve(8) == Layout(dp_replicate=2, dp_shard=2, tp=2)
    _check_mesh(cfg, 8)
    wide = TrainConfig(tp=4, hsdp=2, strategy="fsdp")
    with pytest.raises(ConfigError, match=re.escape("--hsdp 2 x --tp 4 = 8 must divide the "
                                                    "number of ranks (4)")):  # fmt: skip
        _check_mesh(wide, 4)


@pytest.mark.parametrize("command", ["train", "plan"])
def test_train_and_plan_refuse_them_with_status_2(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--strategy", "ddp", "--tp", "2", "--global-batch", "4"]) == 2
    err = capsys.readouterr().err
    assert f"gradstep {command}: error: --tp 2 needs --strategy fsdp" in err, err
