"""Non-finite gradients skip the update and leave every piece of state untouched."""

from __future__ import annotations

import math

import pytest
import torch

import gradstep
from tests.support.asserts import assert_bitwise_equal, snapshot
from tests.support.batches import make_window
from tests.support.models import TinyLM
from tests.support.reference import lm_loss


def poisoned_loss_fn(value: float, which: int):
    calls = {"n": 0}

    def fn(model, mb):
        out = lm_loss(model, mb)
        calls["n"] += 1
        if calls["n"] - 1 == which:
            return gradstep.LossSum(out.total * value, out.count)
        return out

    return fn


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("clip", [gradstep.ClipNorm(1.0), None, gradstep.ClipValue(0.1)])
def test_nonfinite_skips_and_leaves_state_bitwise_unchanged(bad, clip):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    stepper = gradstep.Stepper(model, opt, scheduler=sched, clip=clip)
    mbs, _ = make_window([[4, 6], [3], [5]], seed=1)
    stepper.step(mbs, lm_loss)  # a good step first, so the optimizer has state
    before = snapshot(model, opt)
    epoch = sched.last_epoch
    stats = stepper.step(mbs, poisoned_loss_fn(bad, which=1))
    assert stats.skipped and "non-finite" in stats.skip_reason
    assert not math.isfinite(stats.grad_norm)
    assert_bitwise_equal(snapshot(model, opt), before)
    assert sched.last_epoch == epoch
    assert all(p.grad is None for p in model.parameters())
    assert stepper.skipped_steps == 1 and stepper.step_count == 1
    assert stepper.skip_reasons["non-finite gradient norm"] == 1
    # and training continues normally afterwards
    assert not stepper.step(mbs, lm_loss).skipped and stepper.step_count == 2
