"""Defaults that fit the model (gradstep_cli.config.recipe): the toy GPT and random weights
pretrain, pretrained hf: weights fine-tune with TRL's SFT defaults (LoRA at 10x lr); flags
win; the schedule and optimizer flags are checked when the config is built."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gradstep.checkpoint.codec import encode
from gradstep_cli.cli import build_parser
from gradstep_cli.config.recipe import RECIPES, recipe_note, warmup_arg
from gradstep_cli.config.settings import ConfigError, TrainConfig, resolve
from gradstep_cli.run.folder import merge_settings, resumed_settings, saved_settings

TRL_SFT = {  # trl SFTConfig / transformers TrainingArguments defaults
    "weight_decay": 0.0, "lr_schedule": "linear", "min_lr": 0.0, "warmup": 0,
    "adam_betas": "0.9,0.999", "adam_eps": 1e-8,
}  # fmt: skip


LATER = ("lr_schedule", "adam_betas", "adam_eps", "decay_ratio", "epochs")
"""Settings newer than the checkpoints of issue 29."""


def hf_folder(tmp_path: Path, weights: bool) -> str:
    """A model folder as the recipe sees it: a config, and weights or none."""
    folder = tmp_path / ("pretrained" if weights else "config-only")
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return f"hf:{folder}"


def settings(cfg: TrainConfig, names=TRL_SFT) -> dict:
    return {name: getattr(cfg, name) for name in names}


def test_the_toy_gpt_keeps_its_pretraining_defaults() -> None:
    cfg = TrainConfig()
    assert cfg.recipe == "pretraining"
    assert (cfg.lr, cfg.weight_decay, cfg.lr_schedule, cfg.min_lr) == (3e-3, 0.1, "cosine", 3e-4)
    assert (cfg.warmup, cfg.max_steps, cfg.adam_betas, cfg.adam_eps) == (20, 150, "0.9,0.95", 1e-8)
    assert cfg.betas == (0.9, 0.95)


def test_pretrained_weights_get_trls_sft_defaults(tmp_path: Path) -> None:
    model = hf_folder(tmp_path, weights=True)
    full, lora = TrainConfig(model=model), TrainConfig(model=model, lora=8)
    assert (full.recipe, full.lr) == ("fine-tuning", 2e-5)
    assert (lora.recipe, lora.lr) == ("fine-tuning with LoRA", 2e-4)
    assert settings(full) == settings(lora) == TRL_SFT
    assert full.clip == "norm:1.0"  # TRL's max_grad_norm 1.0
    note = recipe_note(lora)
    assert note.startswith("fine-tuning with LoRA defaults (a pretrained model with LoRA")
    assert "lr 0.0002" in note and "linear schedule to min-lr 0" in note and "no warm-up" in note


def test_random_weights_pretrain_and_flags_win(tmp_path: Path) -> None:
    assert TrainConfig(model=hf_folder(tmp_path, weights=False)).recipe == "pretraining"
    model = hf_folder(tmp_path, weights=True)
    assert TrainConfig(model=model, init="random").lr == 3e-3
    given = TrainConfig(model=model, lr=5e-4, warmup=8, lr_schedule="cosine", weight_decay=0.01)
    assert (given.lr, given.warmup, given.lr_schedule, given.weight_decay) == (
        5e-4, 8, "cosine", 0.01,
    )  # fmt: skip
    assert given.min_lr == 0.0  # the fine-tuning set's floor, whatever lr was given
    assert {"lr", "warmup", "lr_schedule", "weight_decay"}.isdisjoint(given.auto_fields)
    assert "min_lr" in given.auto_fields
    assert recipe_note(given).endswith("cosine schedule to min-lr 0, betas 0.9,0.999, eps 1e-08")


def test_each_optimizer_gets_its_own_moments() -> None:
    lamb = TrainConfig(optimizer="lamb")
    assert (lamb.adam_betas, lamb.adam_eps) == ("0.9,0.999", 1e-6)  # LAMB's own
    sgd = TrainConfig(optimizer="sgd")
    assert (sgd.adam_betas, sgd.adam_eps) == (None, None)  # recorded as null: not used
    assert TrainConfig(adam_betas=" 0.8 , 0.99", adam_eps=1e-6).adam_betas == "0.8,0.99"
    for bad in ("0.9", "0.9,1.0", "a,b", "0.9,0.99,0.999", "-0.1,0.9"):
        with pytest.raises(ConfigError, match="--adam-betas must be B1,B2"):
            TrainConfig(adam_betas=bad)
    with pytest.raises(ConfigError, match="--adam-eps must be > 0"):
        TrainConfig(adam_eps=0.0)
    with pytest.raises(ConfigError, match="--adam-betas set AdamW's and LAMB's moments"):
        resumed_settings(sgd, None, frozenset({"optimizer", "adam_betas"}), 1)


def test_warmup_is_steps_or_a_share(tmp_path: Path) -> None:
    assert [warmup_arg(v) for v in ("8", "8.0", "0", "0.1")] == [8, 8, 0, 0.1]
    assert TrainConfig(warmup=0.1, max_steps=80).warmup == 0.1
    toml = tmp_path / "c.toml"
    toml.write_text("warmup = 8\nmax_steps = 80\n")
    assert resolve(toml).warmup == 8 and isinstance(resolve(toml).warmup, int)
    for bad in (1.5, -1):
        with pytest.raises(ConfigError, match="--warmup must be whole steps"):
            TrainConfig(warmup=bad)
    with pytest.raises(ConfigError, match=r"--warmup must be <= --max-steps \(4\), got 8"):
        TrainConfig(warmup=8, max_steps=4)
    assert TrainConfig(warmup=8, max_steps=80, stop_after=4).stop_after == 4  # the smoke run


def test_schedules_and_their_settings() -> None:
    assert TrainConfig(lr_schedule="wsd").decay_ratio == 0.2
    assert TrainConfig(lr_schedule="wsd", decay_ratio=0.5).decay_ratio == 0.5
    assert TrainConfig(lr_schedule="cosine").decay_ratio is None
    constant = TrainConfig(lr_schedule="constant", lr=1e-3)
    assert constant.min_lr == 1e-3  # no decay: nothing to end at
    with pytest.raises(ConfigError, match="--lr-schedule constant has none"):
        TrainConfig(lr_schedule="constant", min_lr=0.0)
    with pytest.raises(ConfigError, match="--decay-ratio sets the decay of --lr-schedule wsd"):
        TrainConfig(decay_ratio=0.1)
    with pytest.raises(ConfigError, match=r"--decay-ratio must be in \(0, 1\]"):
        TrainConfig(lr_schedule="wsd", decay_ratio=1.5)
    with pytest.raises(ConfigError, match="do not fit in the schedule's 10 steps"):
        TrainConfig(lr_schedule="wsd", decay_ratio=0.5, warmup=6, max_steps=10)
    with pytest.raises(ConfigError, match="--lr-schedule must be one of"):
        TrainConfig(lr_schedule="step")


def test_epochs_and_stop_after() -> None:
    cfg = TrainConfig(epochs=2.5)
    assert cfg.max_steps is None and cfg.warmup is None  # derived once the data is read
    assert "max_steps" in cfg.auto_fields
    # The note says the rule (the start line then says the steps it gave).
    assert "warm-up min(20, max_steps // 5)" in recipe_note(cfg)
    for name, bad in (("epochs", 0.0), ("stop_after", 0), ("max_steps", 0)):
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be"):
            TrainConfig(**{name: bad})
    with pytest.raises(ConfigError, match="--epochs and --max-steps both set the run's length"):
        resumed_settings(TrainConfig(epochs=1.0, max_steps=5), None, {"epochs", "max_steps"}, 1)


def test_the_flags_parse() -> None:
    args = build_parser().parse_args(
        ["train", "--adam-betas", "0.9,0.999", "--adam-eps", "1e-6", "--warmup", "0.1",
         "--lr-schedule", "wsd", "--decay-ratio", "0.1", "--epochs", "1.5", "--stop-after", "4"]
    )  # fmt: skip
    assert (args.adam_betas, args.adam_eps, args.warmup) == ("0.9,0.999", 1e-6, 0.1)
    assert (args.lr_schedule, args.decay_ratio, args.epochs, args.stop_after) == (
        "wsd", 0.1, 1.5, 4,
    )  # fmt: skip


def test_a_resume_keeps_its_recipe_and_older_checkpoints_theirs(tmp_path: Path) -> None:
    model = hf_folder(tmp_path, weights=True)
    saved = TrainConfig(model=model, init="random", max_steps=10).to_dict()  # pretraining
    now = TrainConfig(model=model, max_steps=10)  # fine-tuning defaults, none given
    resumed, notes = merge_settings(now, saved, frozenset(), 4, 10)
    assert (resumed.lr, resumed.lr_schedule, resumed.adam_betas) == (3e-3, "cosine", "0.9,0.95")
    assert "lr_schedule='cosine'" in notes[0]  # said: the checkpoint's, not the new defaults
    # A checkpoint from before --lr-schedule ran a cosine with AdamW betas (0.9, 0.95).
    older = {k: v for k, v in TrainConfig().to_dict().items() if k not in LATER}
    info = SimpleNamespace(manifest={"objects": {"config": {"state": encode(older, "", {})}}})
    legacy = saved_settings(info)
    assert {k: legacy[k] for k in LATER} == {
        "lr_schedule": "cosine", "adam_betas": "0.9,0.95", "adam_eps": 1e-8, "decay_ratio": None,
        "epochs": None,
    }  # fmt: skip
    # An epochs run: a given --max-steps replaces the epochs, a given --epochs the steps.
    epochs = {**saved, "epochs": 2.0}
    by_steps, _ = merge_settings(TrainConfig(max_steps=20), epochs, frozenset({"max_steps"}), 4)
    assert (by_steps.max_steps, by_steps.epochs) == (20, None)
    by_epochs, _ = merge_settings(TrainConfig(epochs=3.0), epochs, frozenset({"epochs"}), 4)
    assert (by_epochs.max_steps, by_epochs.epochs) == (None, 3.0)
    assert RECIPES["fine-tuning"]["lr"] == 2e-5
