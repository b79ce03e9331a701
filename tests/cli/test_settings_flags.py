"""The demo's settings: defaults that fit any run, flags that never claim what they do not
do, and messages that name the flag (issue 20; rows of shared/reviews/robustness-2.md and
hf-client-2.md in each docstring)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradstep.checkpoint import CheckpointInfo
from gradstep_cli.cli import build_parser, main
from gradstep_cli.config.settings import (
    GPT_SHAPE,
    LR_MAX,
    OPTIMIZERS,
    TIMEOUT_RANGE,
    ConfigError,
    TrainConfig,
    resolve,
)
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.run import folder as run_folder
from gradstep_cli.train import build_optimizer
from tests.cli.test_lr_runs import TINY
from tests.support.batches import text_corpus


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(text_corpus(tmp_path_factory.mktemp("settings") / "corpus"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


# ------------------------------------------------------------------ defaults


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


def test_a_short_run_with_default_flags_trains(data, tmp_path) -> None:
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", data, "--max-steps", "3", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["warmup"], config["min_lr"]) == (0, 3e-4)  # the resolved values


def test_min_lr_follows_lr_unless_given(capsys) -> None:
    """N47: `--optimizer lamb --lr 1e-30` was refused about --min-lr, never given."""
    assert TrainConfig(optimizer="lamb", lr=1e-30).min_lr == 1e-31
    assert TrainConfig(lr=0.5).min_lr == 0.05
    with pytest.raises(ConfigError, match=r"--min-lr must be in \[0, --lr 0.001\], got 0.01"):
        TrainConfig(lr=1e-3, min_lr=1e-2)


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


# ---------------------------------------------------- messages that name the flag


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


# ------------------------------------------------- GPT shape flags with hf: models


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


def test_an_hf_run_records_no_gpt_shape(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    hf, out = tmp_path / "llama", tmp_path / "run"
    transformers.LlamaConfig(
        vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    ).save_pretrained(hf)  # fmt: skip
    data = str(text_corpus(tmp_path / "d"))
    argv = ["train", "--model", f"hf:{hf}", "--seq-len", "16", "--micro-batch-size", "2",
            "--accum-steps", "1", "--max-steps", "1", "--eval-batches", "1",
            "--sample-tokens", "0", "--data", data, "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert [config[name] for name in GPT_SHAPE] == [None, None, None]


def _fake_checkpoint(settings: dict) -> CheckpointInfo:
    """A checkpoint's manifest as the run folder reads it (settings in 'config')."""
    manifest = {"world_size": 1, "accum_steps": 2, "objects": {"config": {"state": settings}}}
    return CheckpointInfo(4, Path("/nowhere/checkpoints/step-000004"), manifest)


def test_an_older_hf_checkpoint_with_gpt_shape_ints_still_resumes() -> None:
    """Checkpoints of hf: runs saved n_layer 4, n_head 4, d_model 160 (the GPT defaults)."""
    saved = TrainConfig(model="hf:cfg", accum_steps=2, max_steps=4).to_dict()
    saved.update(GPT_SHAPE)  # what an older gradstep recorded
    for name in run_folder.ENVIRONMENT:
        saved.pop(name)
    now = TrainConfig(max_steps=8)  # `--resume --max-steps 8`, no --model: the checkpoint's
    info = _fake_checkpoint(saved)
    merged, notes = run_folder.resumed_settings(now, info, frozenset({"max_steps"}), 1)
    assert merged.model == "hf:" + os.path.abspath("cfg") and merged.max_steps == 8
    assert (merged.n_layer, merged.n_head, merged.d_model) == (None, None, None)
    assert not any("n_layer" in line for line in notes)
    # No horizon saved with its schedule (older checkpoints): the run's max_steps is.
    assert run_folder.schedule_horizon(info) == 4
    assert any("keeps the checkpoint's max_steps 4" in line for line in notes), notes


# ------------------------------------------------------------ notes, not silence


def test_noise_scale_settings_that_do_nothing_get_a_note(data, tmp_path, capsys) -> None:
    """N44: --gns-beta without --gns; N43: --gns with 1 micro-batch per step (gns_b_simple
    stays null): both were silent."""
    base = ["train", *TINY, "--data", data, "--max-steps", "1"]
    code, err = run(capsys, *base, "--gns-beta", "0.5", "--out", str(tmp_path / "a"))
    assert code == 0 and "--gns-beta has no effect without --gns" in err
    code, err = run(capsys, *base, "--gns", "--accum-steps", "1", "--out", str(tmp_path / "b"))
    assert code == 0 and "gns_b_simple stays null" in err and "--accum-steps" in err
    record = json.loads((tmp_path / "b" / "metrics.jsonl").read_text())
    assert record["gns_b_simple"] is None  # what the note says
    code, err = run(capsys, *base, "--gns", "--out", str(tmp_path / "c"))  # 2: measured
    assert code == 0 and "note:" not in err


# ----------------------------------------------------------- resume messages


def test_resume_messages_say_what_is_true(data, tmp_path, capsys) -> None:
    """O24: 'unusable ones are listed above' with none listed; O29/N136: --resume-or-start
    errors named --resume; N98: a lock-file problem did not name the lock file."""
    empty = tmp_path / "empty"
    empty.mkdir()
    base = ["train", *TINY, "--data", data, "--max-steps", "2"]
    code, err = run(capsys, *base, "--resume", str(empty), "--out", str(tmp_path / "x"))
    assert code == 2 and "no valid checkpoint" in err and "listed above" not in err, err
    held = tmp_path / "held"  # a run without checkpoints
    assert run(capsys, *base, "--out", str(held))[0] == 0
    code, err = run(capsys, *base, "--resume-or-start", "--out", str(held))
    assert code == 2 and "error: --resume-or-start: no valid checkpoint" in err, err
    ckpt = tmp_path / "ckpt"
    assert run(capsys, *base, "--save-every", "1", "--out", str(ckpt))[0] == 0
    for model in (ckpt / "checkpoints").glob("step-*/model.safetensors"):
        flipped = bytearray(model.read_bytes())
        flipped[-1] ^= 0xFF
        model.write_bytes(bytes(flipped))
    code, err = run(capsys, *base, "--resume", "--max-steps", "3", "--out", str(ckpt))
    assert code == 2 and "(the unusable ones are listed above)" in err, err
    locked = tmp_path / "lockdir"
    (locked / ".gradstep.lock").mkdir(parents=True)
    code, err = run(capsys, *base, "--out", str(locked))
    assert code == 2 and str(locked / ".gradstep.lock") in err and "lock file" in err, err
