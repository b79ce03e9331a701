"""The gradient noise scale: the estimator against the exact per-example covariance.

The truth is computed by brute force on a small regression problem: every example's own
gradient at fixed parameters (learning rate 0), their mean G and population covariance
Sigma, B_simple = tr(Sigma) / |G|^2. Windows draw their micro-batches with replacement from
the dataset, which is exactly the sampling the estimator assumes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradstep
from gradstep import GradientNoiseScale, LossSum, Stepper, scale_lr

D = 6
M = 400  # examples in the dataset


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, 1, generator=g, dtype=torch.float64)
    y = x @ w + 1.5 * torch.randn(M, 1, generator=g, dtype=torch.float64)
    return x, y


def _model() -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(D, 1).double()  # far from the fit: |G| is not small


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    x, y = batch
    return LossSum(0.5 * (model(x) - y).square().sum(), x.shape[0])


def _truth(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    grads = []
    for i in range(M):
        model.zero_grad()
        _loss(model, (x[i : i + 1], y[i : i + 1])).total.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    g = torch.stack(grads)
    mean = g.mean(0)
    trace = (g - mean).square().sum(1).mean()
    model.zero_grad()
    return {"grad_sq": float(mean.square().sum()), "trace_cov": float(trace)}


def _windows(x, y, sizes, steps, seed=2):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        window = []
        for n in sizes:
            idx = torch.randint(0, M, (n,), generator=g)
            window.append((x[idx], y[idx]))
        yield window


def _measure(sizes, steps, beta=0.99, **stepper_kw) -> tuple[GradientNoiseScale, dict]:
    x, y = _problem()
    model = _model()
    truth = _truth(model, x, y)
    gns = GradientNoiseScale(beta=beta)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stepper = Stepper(model, opt, clip=None, hooks=[gns], **stepper_kw)
    for window in _windows(x, y, sizes, steps):
        stepper.step(window, _loss)
    return gns, truth


@pytest.mark.parametrize("sizes", [(8, 8, 8, 8), (3, 13, 8, 1, 5)], ids=["equal", "unequal"])
def test_b_simple_within_20_percent_of_the_exact_noise_scale(sizes):
    gns, truth = _measure(sizes, steps=600)
    want = truth["trace_cov"] / truth["grad_sq"]
    assert 5 < want < 200  # a problem where the noise scale is neither 0 nor infinite
    assert gns.measured_steps == 600
    assert gns.b_simple == pytest.approx(want, rel=0.20)
    assert gns.grad_sq == pytest.approx(truth["grad_sq"], rel=0.20)
    assert gns.trace_cov == pytest.approx(truth["trace_cov"], rel=0.20)


def _brute_force_window(model, window):
    """The unbiased estimates of one window, from float64 gradients taken one by one."""
    sums = []
    for mb in window:
        model.zero_grad()
        _loss(model, mb).total.backward()
        sums.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    n = torch.tensor([float(mb[0].shape[0]) for mb in window], dtype=torch.float64)
    big = torch.stack(sums).sum(0)
    a = sum(float(s.square().sum()) for s in sums)
    q, total = float(n.square().sum()), float(n.sum())
    grad_sq = (float(big.square().sum()) - a) / (total**2 - q)
    model.zero_grad()
    return grad_sq, (a - q * grad_sq) / total


def test_each_windows_raw_estimate_and_the_bias_corrected_ema_by_hand():
    x, y = _problem()
    model = _model()
    beta = 0.9
    gns = GradientNoiseScale(beta=beta)
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None, hooks=[gns])
    raw = []
    for window in _windows(x, y, (2, 7, 4), steps=5):
        want = _brute_force_window(model, window)
        stepper.step(window, _loss)
        got = gns.last
        assert got["grad_sq"] == pytest.approx(want[0], rel=1e-10)
        assert got["trace_cov"] == pytest.approx(want[1], rel=1e-10)
        raw.append(want)
    for part, i in (("grad_sq", 0), ("trace_cov", 1)):
        ema = 0.0
        for r in raw:
            ema = beta * ema + (1 - beta) * r[i]
        assert getattr(gns, part) == pytest.approx(ema / (1 - beta ** len(raw)), rel=1e-12)
    assert gns.b_simple == pytest.approx(gns.trace_cov / gns.grad_sq, rel=1e-12)


def test_a_window_of_one_micro_batch_is_not_measured():
    gns, _ = _measure((16,), steps=3)
    assert gns.measured_steps == 0
    assert gns.b_simple is None and gns.grad_sq is None
    assert math.isnan(gns.last["grad_sq"])


def test_skipped_steps_are_not_measured_and_the_state_round_trips():
    x, y = _problem()
    model = _model()
    gns = GradientNoiseScale(beta=0.5)
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None, hooks=[gns])
    windows = list(_windows(x, y, (4, 4), steps=3))
    stepper.step(windows[0], _loss)
    before = gns.state_dict()
    bad = [(windows[1][0][0], windows[1][0][1] * math.inf), windows[1][1]]
    assert stepper.step(bad, _loss).skipped
    assert gns.state_dict() == before  # the non-finite window left no trace
    twin = GradientNoiseScale(beta=0.5)
    twin.load_state_dict(gns.state_dict())
    assert (twin.b_simple, twin.measured_steps, twin.last) == (
        gns.b_simple,
        gns.measured_steps,
        gns.last,
    )
    with pytest.raises(ValueError, match="beta=0.5"):
        GradientNoiseScale(beta=0.9).load_state_dict(gns.state_dict())


def test_resumed_through_the_stepper_state_continues_exactly():
    x, y = _problem()
    windows = list(_windows(x, y, (3, 5, 4), steps=6))

    def run(split: int | None) -> float:
        model = _model()
        gns = GradientNoiseScale(beta=0.8)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        stepper = Stepper(model, opt, clip=None, hooks=[gns])
        for i, window in enumerate(windows):
            if i == split:
                state = (model.state_dict(), opt.state_dict(), stepper.state_dict())
                model = _model()
                gns = GradientNoiseScale(beta=0.8)
                opt = torch.optim.SGD(model.parameters(), lr=1e-3)
                stepper = Stepper(model, opt, clip=None, hooks=[gns])
                model.load_state_dict(state[0])
                opt.load_state_dict(state[1])
                stepper.load_state_dict(state[2])
            stepper.step(window, _loss)
        return gns.b_simple

    assert run(split=3) == run(split=None)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_measures_the_same_noise_scale(precision):
    """fp16's loss scale is undone; bf16's squared norms are taken in float32. Window by
    window against the float64 measurement, to the precision's own rounding; the windows
    fp16 skips (its first loss scales overflow) are not measured."""
    x, y = _problem()
    windows = list(_windows(x, y, (8, 8, 8), steps=30))

    def run(dtype, prec):
        model = _model().to(dtype)
        gns = GradientNoiseScale(beta=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        stepper = Stepper(model, opt, clip=None, hooks=[gns], precision=prec)
        seen = {}
        for i, window in enumerate(windows):
            stats = stepper.step([(a.to(dtype), b.to(dtype)) for a, b in window], _loss)
            if not stats.skipped:
                seen[i] = gns.last
        return gns, seen

    ref, want = run(torch.float64, "fp32")
    got, seen = run(torch.float32 if precision == "fp16" else torch.bfloat16, precision)
    assert got.measured_steps == len(seen) >= 20
    for i, last in seen.items():
        for part in ("grad_sq", "trace_cov"):
            assert last[part] == pytest.approx(want[i][part], rel=0.05), (i, part)


def test_bad_beta_is_refused():
    for beta in (1.0, -0.1, "0.9", True):
        with pytest.raises(ValueError, match=r"beta must be a number in \[0, 1\)"):
            GradientNoiseScale(beta=beta)


def test_scale_lr_rules():
    assert scale_lr(0.1, 32, 8, "linear") == pytest.approx(0.4)
    assert scale_lr(0.1, 32, 8, "sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 32, 8, "none") == 0.1
    assert scale_lr(0.1, 2, 8, "sqrt") == pytest.approx(0.05)
    with pytest.raises(ValueError, match="rule must be one of none, linear, sqrt"):
        scale_lr(0.1, 2, 8, "cubic")
    with pytest.raises(ValueError, match="base_batch must be a finite number > 0"):
        scale_lr(0.1, 2, 0, "linear")
    assert gradstep.scale_lr is scale_lr


@pytest.mark.parametrize("lr", [-1e-3, -1e-300, float("nan"), float("inf"), True])
def test_scale_lr_refuses_an_lr_that_is_not_a_finite_number_ge_0(lr):
    with pytest.raises(ValueError, match=r"scale_lr: lr must be a finite number >= 0"):
        scale_lr(lr, 2, 1, "linear")
    assert scale_lr(0.0, 2, 1, "linear") == 0.0
