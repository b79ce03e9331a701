"""The demo's LR schedule in sequences, the batch ramp, and their resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import gradstep
from gradstep_cli.cli import main
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.run.schedule import GNS_PATIENCE, BatchRamp, LRSchedule, WarmupCosine, parse_ramp
from tests.cli.test_cli import TINY, read_jsonl
from tests.support.batches import text_corpus


def test_without_a_ramp_the_schedule_is_the_step_keyed_one_exactly():
    """Full steps only: the sequence clock is the step count, so the LR of every step is
    what LambdaLR(WarmupCosine) gives, skipped steps included (neither advances on one)."""
    shape = WarmupCosine(warmup=3, max_steps=12, min_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    ref = torch.optim.lr_scheduler.LambdaLR(opt, shape)
    schedule = LRSchedule(shape, 0.5, base_micro_batches=4)
    skipped = {4, 7}
    for step in range(12):
        assert schedule.lr_for(4) == opt.param_groups[0]["lr"]
        schedule.advance(4, taken=step not in skipped)
        if step not in skipped:
            opt.step()
            ref.step()


@pytest.mark.parametrize(("rule", "factor"), [("none", 1.0), ("linear", 0.25), ("sqrt", 0.5)])
def test_a_ramped_step_advances_the_clock_by_its_share_and_scales_its_lr(rule, factor):
    shape = WarmupCosine(warmup=2, max_steps=10, min_ratio=0.0)
    schedule = LRSchedule(shape, 1.0, base_micro_batches=4, scaling=rule)
    assert schedule.lr_for(1) == pytest.approx(factor * shape(0))
    schedule.advance(1, taken=True)  # a quarter of a full step
    assert schedule.lr_for(1) == pytest.approx(factor * shape(0.25))
    for _ in range(3):
        schedule.advance(1, taken=True)
    assert schedule.lr_for(4) == pytest.approx(shape(1.0))  # 4 quarter steps = 1 full step
    twin = LRSchedule(shape, 1.0, 4, rule)
    twin.load_state_dict(schedule.state_dict())
    assert twin.lr_for(2) == schedule.lr_for(2)
    with pytest.raises(ValueError, match="LambdaLR"):
        twin.load_state_dict({"last_epoch": 3, "base_lrs": [1.0]})


def test_linear_ramp_is_a_pure_function_of_the_step():
    ramp = BatchRamp.from_spec("1:6", full=4, world=1)
    assert [ramp.micro_batches(s) for s in range(9)] == [1, 1, 2, 2, 3, 3, 4, 4, 4]
    assert BatchRamp.from_spec("4:3", full=4, world=2).micro_batches(0) == 4
    with pytest.raises(ValueError, match="must be <= --accum-steps"):
        BatchRamp.from_spec("5:3", full=4, world=1)


def test_gns_ramp_doubles_when_the_noise_scale_exceeds_the_batch_and_never_shrinks():
    ramp = BatchRamp.from_spec("gns", full=6, world=1)
    assert ramp.micro_batches(0) == 2  # two micro-batches: the least that measures noise
    assert BatchRamp.from_spec("gns", full=6, world=2).micro_batches(0) == 1
    big = 1e9
    assert not ramp.observe(5, big, 100, measured=GNS_PATIENCE - 1)  # too few measured
    assert not ramp.observe(GNS_PATIENCE, None, 100, measured=GNS_PATIENCE)  # unmeasurable
    assert not ramp.observe(GNS_PATIENCE, 99.0, 100, measured=GNS_PATIENCE)  # below batch
    assert ramp.observe(GNS_PATIENCE, 101.0, 100, measured=GNS_PATIENCE)
    assert ramp.micro_batches(GNS_PATIENCE + 1) == 4
    twin = BatchRamp.from_spec("gns", full=6, world=1)
    twin.load_state_dict(ramp.state_dict())  # a resume continues the grown ramp
    assert twin == ramp
    assert not ramp.observe(GNS_PATIENCE + 1, big, 100, measured=big)  # patience
    assert ramp.observe(2 * GNS_PATIENCE, big, 100, measured=big)
    assert ramp.micro_batches(0) == 6  # capped at --accum-steps
    assert not ramp.observe(10 * GNS_PATIENCE, big, 100, measured=big)
    ramp.observe(20 * GNS_PATIENCE, 1.0, 10**6, measured=big)
    assert ramp.micro_batches(0) == 6  # a small noise scale never shrinks it


def test_ramp_settings_are_checked():
    assert parse_ramp("2:50") == ("linear", 2, 50)
    for bad in ("2", "0:5", "2:0", "a:b", "gns:2", "-1:3"):
        with pytest.raises(ConfigError, match="--batch-ramp must be START:STEPS"):
            TrainConfig(batch_ramp=bad)
    with pytest.raises(ConfigError, match="--batch-ramp START .5. must be <= --accum-steps .4."):
        TrainConfig(batch_ramp="5:10", accum_steps=4)
    with pytest.raises(ConfigError, match="--global-batch"):
        TrainConfig(batch_ramp="1:10", global_batch=16)
    with pytest.raises(ConfigError, match="--lr-scaling must be one of none, linear, sqrt"):
        TrainConfig(lr_scaling="cube")
    with pytest.raises(ConfigError, match="--gns-beta"):
        TrainConfig(gns_beta=1.0)
    assert TrainConfig(batch_ramp="gns").measures_gns


RAMP = [*TINY, "--accum-steps", "4", "--max-steps", "6", "--eval-every", "0"]


@pytest.mark.parametrize("ramp", ["1:5", "gns"])
def test_ramped_run_records_and_resumes_exactly(
    tmp_path: Path, ramp: str, monkeypatch: pytest.MonkeyPatch
):
    """A run resumed from a checkpoint in the middle of its ramp continues it exactly:
    every metrics line (batch, LR, noise scale, loss) equals the uninterrupted run's."""
    data = str(text_corpus(tmp_path / "data"))
    args = [*RAMP, "--data", data, "--batch-ramp", ramp, "--lr-scaling", "sqrt", "--gns"]
    args += ["--gns-beta", "0.5"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["train", *args, "--out", str(whole)]) == 0
    rows = read_jsonl(whole / "metrics.jsonl")
    per_step = [r["micro_batches"] for r in rows]
    assert sum(per_step) == 6 * 4  # the budget: max_steps full batches
    # Growing, the last window taking only what is left of the budget.
    assert per_step[:-1] == sorted(per_step[:-1]) and per_step[0] < 4
    if ramp == "1:5":
        assert per_step[:5] == [1, 1, 2, 2, 3]
    shape = WarmupCosine(1, 6, 3e-4 / 3e-3)
    clock = 0.0
    for r in rows:  # the LR follows the sequence clock and the sqrt rule
        assert r["lr"] == pytest.approx(3e-3 * math.sqrt(r["micro_batches"] / 4) * shape(clock))
        clock += r["micro_batches"] / 4
    assert all(isinstance(r["items"], int) and r["items"] > 0 for r in rows)
    assert rows[-1]["gns_b_simple"] is not None

    real_step, calls = gradstep.Stepper.step, []

    def crash_in_step_5(self, *a, **kw):  # a kill in the middle of the ramp
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_step(self, *a, **kw)

    monkeypatch.setattr(gradstep.Stepper, "step", crash_in_step_5)
    assert main(["train", *args, "--out", str(cut), "--save-every", "3"]) == 130
    monkeypatch.undo()
    assert main(["train", *args, "--out", str(cut), "--resume"]) == 0
    resumed = read_jsonl(cut / "metrics.jsonl")
    keys = ("micro_batches", "items", "lr", "loss", "grad_norm", "gns_b_simple")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in rows]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["steps"] == len(rows)


@pytest.mark.parametrize("optimizer", ["sgd", "lars", "lamb"])
def test_every_optimizer_follows_the_ramp_and_its_lr_scaling(tmp_path: Path, optimizer: str):
    data = str(text_corpus(tmp_path / "data"))
    args = [*RAMP, "--data", data, "--optimizer", optimizer, "--batch-ramp", "1:3"]
    args += ["--lr-scaling", "linear", "--max-steps", "3", "--sample-tokens", "0"]
    assert main(["train", *args, "--out", str(tmp_path / "o")]) == 0
    rows = read_jsonl(tmp_path / "o" / "metrics.jsonl")
    shape, clock = WarmupCosine(1, 3, 3e-4 / 3e-3), 0.0
    assert [r["micro_batches"] for r in rows][:3] == [1, 2, 3]
    for r in rows:
        assert r["lr"] == pytest.approx(3e-3 * r["micro_batches"] / 4 * shape(clock))
        clock += r["micro_batches"] / 4
