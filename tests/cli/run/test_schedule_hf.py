"""The LR schedules against transformers' ``get_scheduler``, step by step: the same numbers
typed give the same learning rate at every step (``--warmup W --lr-schedule K --min-lr 0``,
or wsd's ``--decay-ratio``), as docs/guide/coming-from-trl.md promises."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.run.schedule import LRSchedule, LRShape, shape_of, warmup_steps

transformers = pytest.importorskip("transformers")

LR = 5e-4


def hf_lrs(name: str, steps: int, warmup: int, **kwargs) -> list[float]:
    """The learning rate of each of ``steps`` optimizer steps under transformers'
    scheduler: read before the step, stepped after it (the Trainer's order)."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=LR)
    scheduler = transformers.get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=steps,
        scheduler_specific_kwargs=kwargs or None,
    )
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def our_lrs(shape: LRShape, steps: int) -> list[float]:
    schedule = LRSchedule(shape, LR, base_micro_batches=1)
    out = []
    for _ in range(steps):
        out.append(schedule.lr_for(1))
        schedule.advance(1, taken=True)
    return out


def max_delta(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


HF_NAMES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


@given(
    kind=st.sampled_from(["cosine", "linear", "constant"]),
    steps=st.integers(1, 120),
    warmup=st.integers(0, 120),
)
def test_cosine_linear_and_constant_equal_transformers_to_zero(
    kind: str, steps: int, warmup: int
) -> None:
    warmup = min(warmup, steps)
    min_lr = LR if kind == "constant" else 0.0
    cfg = TrainConfig(
        max_steps=steps, warmup=warmup, lr=LR, lr_schedule=kind, min_lr=min_lr, clip="none"
    )
    ours = our_lrs(shape_of(cfg, steps), steps)
    assert max_delta(ours, hf_lrs(HF_NAMES[kind], steps, warmup)) <= 1e-18


@given(steps=st.integers(1, 120), warmup=st.integers(0, 120), ratio=st.floats(0.0, 1.0))
def test_cosine_to_min_lr_equals_cosine_with_min_lr(steps: int, warmup: int, ratio: float):
    warmup = min(warmup, steps)
    cfg = TrainConfig(max_steps=steps, warmup=warmup, lr=LR, min_lr=LR * ratio)
    expected = hf_lrs("cosine_with_min_lr", steps, warmup, min_lr_rate=cfg.min_lr / LR)
    assert max_delta(our_lrs(shape_of(cfg, steps), steps), expected) <= 1e-18


@given(
    steps=st.integers(2, 120),
    warmup=st.integers(0, 60),
    ratio=st.floats(0.01, 1.0),
    floor=st.floats(0.0, 1.0),
)
def test_wsd_equals_warmup_stable_decay(steps: int, warmup: int, ratio: float, floor: float):
    """wsd: warm-up from min-lr, stable, then a cosine over the last ceil(ratio x steps)
    steps to --min-lr: transformers' warmup_stable_decay with num_decay_steps and
    min_lr_ratio."""
    decay = math.ceil(round(ratio * steps, 9))
    warmup = min(warmup, steps - decay)
    cfg = TrainConfig(
        max_steps=steps, warmup=warmup, lr=LR, min_lr=LR * floor, lr_schedule="wsd",
        decay_ratio=ratio,
    )  # fmt: skip
    shape = shape_of(cfg, steps)
    assert shape.decay == decay
    expected = hf_lrs(
        "warmup_stable_decay", steps, warmup, num_decay_steps=decay, min_lr_ratio=cfg.min_lr / LR
    )
    assert max_delta(our_lrs(shape, steps), expected) <= 1e-18


@pytest.mark.parametrize("steps", [1, 9, 80, 101])
@pytest.mark.parametrize("share", [0.03, 0.1, 0.5])
def test_a_warmup_share_is_transformers_warmup_ratio(steps: int, share: float) -> None:
    """--warmup 0.1 is transformers' warmup_steps=0.1: ceil(0.1 x steps) steps."""
    param = torch.nn.Parameter(torch.zeros(1))
    args = transformers.TrainingArguments(output_dir="unused", warmup_steps=share, max_steps=steps)
    assert warmup_steps(share, steps) == args.get_warmup_steps(steps)
    cfg = TrainConfig(max_steps=steps, warmup=share, lr=LR, min_lr=0.0)
    expected = hf_lrs("cosine", steps, args.get_warmup_steps(steps))
    assert max_delta(our_lrs(shape_of(cfg, steps), steps), expected) <= 1e-18
    del param


def test_the_walks_recipe_is_transformers_curve() -> None:
    """The walk's full fine-tune (shared/reviews/finetune-walk-3.md): 80 steps, warm-up 8,
    cosine to 0, lr 5e-4; it had to inject a LambdaLR into TRL to match gradstep's."""
    cfg = TrainConfig(max_steps=80, warmup=8, lr=LR, min_lr=0.0)
    ours, theirs = our_lrs(shape_of(cfg, 80), 80), hf_lrs("cosine", 80, 8)
    assert ours[0] == 0.0 and ours[8] == LR  # from 0, like transformers'
    assert max_delta(ours, theirs) == 0.0
