"""The norm taken during the last backward (``norm_in_backward``) against the pass after it.

Two Steppers on identical copies, one measuring each gradient's norm as it becomes final
(post-accumulate-grad hooks; FSDP2's on the reduce-scattered shards; DDP's on the reduced
buckets through a communication hook), one measuring after backward: the same pre-clip norm
to rounding, every norm type, with and without sync on every micro-batch, on one process
and on 2 gloo ranks. A window that raises leaves no hook behind.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import gradstep
from gradstep.step.norm import EarlyNorm
from tests.support.batches import make_windows
from tests.support.models import tiny_gpt
from tests.support.reference import lm_loss

NORM_TYPES = (1.0, 2.0, 3.0, math.inf)
FP32 = 1e-6
FP64 = 1e-12


class _Used:
    """Counts the steps whose norm came from the hooks (EarlyNorm.local calls)."""

    def __init__(self, monkeypatch=None) -> None:
        self.calls = 0
        real = EarlyNorm.local

        def local(norm, device):
            self.calls += 1
            return real(norm, device)

        if monkeypatch is not None:
            monkeypatch.setattr(EarlyNorm, "local", local)
        else:
            EarlyNorm.local = local  # a rank process of its own


def _pair(model, norm_type, **kw):
    twin = copy.deepcopy(model)
    steppers = []
    for m, early in ((model, True), (twin, False)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        clip = gradstep.ClipNorm(0.1, norm_type=norm_type)
        steppers.append(gradstep.Stepper(m, opt, clip=clip, norm_in_backward=early, **kw))
    return steppers


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_process_same_norm_as_after_backward(monkeypatch, norm_type, dtype):
    used = _Used(monkeypatch)
    early, post = _pair(tiny_gpt(dtype), norm_type)
    tol = FP32 if dtype == torch.float32 else FP64
    for window in make_windows(3, 1, 4, seed=2):
        a, b = early.step(window[0], lm_loss), post.step(window[0], lm_loss)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=tol)
        assert a.clipped and b.clipped  # the clip (and so the multiply) acted
    assert used.calls == 3  # every step measured in backward, and only the early Stepper
    for pa, pb in zip(early.model.parameters(), post.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=tol * 10, atol=tol * 10)


def test_bf16_autocast_and_hooks_inside_the_window_use_the_hooks_too(monkeypatch):
    """The full per-micro-batch path (autocast, an on_param_grad observer) measures in
    backward as well; fp16 (loss scaling) and fp32 accumulation buffers do not."""
    used = _Used(monkeypatch)
    gns = gradstep.GradientNoiseScale()
    early, post = _pair(tiny_gpt(), 2.0, precision="bf16", hooks=[gns])
    window = make_windows(1, 1, 3, seed=4)[0][0]
    a, b = early.step(window, lm_loss), post.step(window, lm_loss)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=FP32)
    assert used.calls == 1
    fp16, _ = _pair(tiny_gpt(), 2.0, precision="fp16")
    fp16.step(window, lm_loss)
    assert used.calls == 1


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        raise RuntimeError("backward failed")


def _raising_last(calls: list, k: int):
    def loss_fn(model, mb):
        out = lm_loss(model, mb)
        calls.append(1)
        if len(calls) == k:
            return gradstep.LossSum(_Boom.apply(out.total), out.count)
        return out

    return loss_fn


def _hooks_left(model) -> int:
    return sum(
        len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()
    )


def test_a_window_that_raises_in_its_last_backward_leaves_no_hook():
    model = tiny_gpt(torch.float64)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = gradstep.Stepper(model, opt, norm_in_backward=True)
    windows = make_windows(2, 1, 3, seed=6)
    with pytest.raises(RuntimeError, match="backward failed"):
        stepper.step(windows[0][0], _raising_last([], 3))
    assert _hooks_left(model) == 0
    assert stepper.norm_in_backward  # the hooks were there, and are gone
    stats = stepper.step(windows[1][0], lm_loss)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref = gradstep.Stepper(reference, ref_opt, norm_in_backward=True)
    want = ref.step(windows[1][0], lm_loss)
    assert stats.grad_norm == want.grad_norm
    for pa, pb in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(pa, pb)


# ------------------------------------------------------------ 2 gloo ranks, real runs


def test_auto_measures_in_backward_from_32_mib_of_gradients():
    small = torch.nn.Linear(64, 64)
    big = torch.nn.Linear(2900, 2900)  # 8.4M parameters: 32.1 MiB of fp32 gradients
    frozen = torch.nn.Linear(2900, 2900).requires_grad_(False)
    for model, want in ((small, False), (big, True), (frozen, False)):
        params = [p for p in model.parameters() if p.requires_grad] or [
            torch.nn.Parameter(torch.zeros(1))
        ]
        opt = torch.optim.SGD(params, lr=0.1)
        assert gradstep.Stepper(model, opt).norm_in_backward is want
    with pytest.raises(ValueError, match="norm_in_backward must be True, False or 'auto'"):
        gradstep.Stepper(small, torch.optim.SGD(small.parameters(), lr=0.1), norm_in_backward="on")
