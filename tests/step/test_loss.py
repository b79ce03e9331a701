"""LossSum / token_loss, and the clear errors a wrong loss_fn or window gets."""

from __future__ import annotations

import pytest
import torch

import gradstep
from tests.support.asserts import assert_bitwise_equal, snapshot
from tests.support.batches import make_window
from tests.support.models import TinyLM
from tests.support.reference import lm_loss


def test_token_loss_is_sum_and_count_of_non_ignored_tokens():
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    labels = torch.tensor([[1, 2, -100, 3, -100], [4, -100, -100, -100, 6]])
    out = gradstep.token_loss(logits, labels)
    keep = labels != -100
    expected = -torch.log_softmax(logits, -1)[keep].gather(1, labels[keep][:, None]).sum()
    assert int(out.count) == 5
    torch.testing.assert_close(out.total, expected, rtol=1e-12, atol=0)


def test_token_loss_custom_ignore_index_and_low_precision_upcast():
    logits = torch.randn(3, 4, dtype=torch.bfloat16)
    out = gradstep.token_loss(logits, torch.tensor([0, 9, 2]), ignore_index=9)
    assert int(out.count) == 2 and out.total.dtype == torch.float32


def test_token_loss_shape_mismatch():
    with pytest.raises(ValueError, match="does not match labels shape"):
        gradstep.token_loss(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def make_stepper():
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, gradstep.Stepper(model, opt)


@pytest.mark.parametrize(
    ("returns", "error", "match"),
    [
        (lambda out: out.total / out.count, TypeError, "LossSum.*plain tensor"),
        (lambda out: (out.total, out.count), TypeError, "must return gradstep.LossSum"),
        (lambda out: gradstep.LossSum(out.total, -3), ValueError, "count must be >= 0"),
        (lambda out: gradstep.LossSum(out.total, torch.tensor(-3)), ValueError, "negative"),
        (lambda out: gradstep.LossSum(out.total, 2.5), TypeError, "count must be an int"),
        (lambda out: gradstep.LossSum(out.total[None], 3), TypeError, "0-dim"),
    ],
)
def test_bad_loss_fn_output_is_rejected_without_corrupting_state(returns, error, match):
    model, opt, stepper = make_stepper()
    mbs, _ = make_window([[4], [5]], seed=0)
    stepper.step(mbs, lm_loss)
    before = snapshot(model, opt)
    with pytest.raises(error, match=match):
        stepper.step(mbs, lambda m, mb: returns(lm_loss(m, mb)))
    assert_bitwise_equal(snapshot(model, opt), before)
    assert all(p.grad is None for p in model.parameters())
    assert stepper.step_count == 1


@pytest.mark.parametrize("size", [0, -1, 1.5, None, True])
def test_window_size_must_be_positive_int(size):
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        gradstep.windows(range(4), size)


def test_empty_or_wrongly_shaped_window():
    _, _, stepper = make_stepper()
    with pytest.raises(ValueError, match="micro_batches is empty"):
        stepper.step([], lm_loss)
    mbs, _ = make_window([[4]], seed=0)
    with pytest.raises(TypeError, match="iterable of micro-batches"):
        stepper.step(mbs[0], lm_loss)


def test_stepper_argument_types():
    model = TinyLM()
    with pytest.raises(TypeError, match="optimizer must be"):
        gradstep.Stepper(model, "adam")
    with pytest.raises(TypeError, match="model must be"):
        gradstep.Stepper(lambda x: x, torch.optim.SGD(model.parameters(), lr=0.1))
