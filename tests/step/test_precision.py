"""Mixed precision: fp16 loss scaling, bf16 autocast, fp32 accumulation of bf16 gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradstep
from tests.support.asserts import assert_bitwise_equal, rel_err, snapshot
from tests.support.batches import collate, make_window
from tests.support.models import BF16Linear, TinyLM
from tests.support.reference import lm_loss, reference_grads

WINDOW = [[5, 9], [2], [11, 3, 4], [6]]


def fp16_run(clip=None, poison=None):
    torch.manual_seed(0)
    model = TinyLM()
    mbs, seqs = make_window(WINDOW, seed=3)
    ref, _ = reference_grads(model, collate(seqs))
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    stepper = gradstep.Stepper(m, opt, clip=clip, precision="fp16")

    def fn(model, mb):
        out = lm_loss(model, mb)
        return gradstep.LossSum(out.total * poison, out.count) if poison else out

    # GradScaler starts at 2^16 and may overflow first: a skipped step, scale halved.
    overflows = 0
    for _ in range(20):
        stats = stepper.step(mbs, fn)
        if not stats.skipped or poison:
            break
        assert "non-finite" in stats.skip_reason
        overflows += 1
    return stepper, stats, ref, m, opt, overflows


def test_fp16_pre_clip_norm_and_gradient_match_fp32_reference():
    stepper, stats, ref, m, _, overflows = fp16_run(clip=gradstep.ClipNorm(1e6))
    expected = float(torch.nn.utils.get_total_norm(ref))
    assert not stats.skipped and stepper.step_count == 1
    assert stats.grad_norm == pytest.approx(expected, rel=5e-3)  # fp16 compute tolerance
    # unscaled exactly once: the gradient is the reference's, not scale x reference
    assert rel_err([p.grad for p in m.parameters()], ref) <= 5e-3
    # GradScaler's documented start is 2^16; each overflow seen before this step halved it
    # once, and a taken step leaves it (growth only after 2000 clean steps).
    assert stats.loss_scale == 2.0**16 * 0.5**overflows


def test_fp16_clip_acts_on_the_unscaled_gradient():
    _, _, ref, _, _, _ = fp16_run()
    full = float(torch.nn.utils.get_total_norm(ref))
    _, stats, _, m, _, _ = fp16_run(clip=gradstep.ClipNorm(full / 2))
    assert stats.clipped and stats.clip_coef == pytest.approx(0.5, rel=5e-3)
    after = float(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
    assert after == pytest.approx(full / 2, rel=1e-4)


def test_fp16_overflow_skips_and_lowers_the_scale():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper = gradstep.Stepper(model, opt, precision="fp16")
    mbs, _ = make_window(WINDOW, seed=3)
    overflows = 0
    while stepper.step(mbs, lm_loss).skipped:  # the initial 2^16 scale may overflow
        overflows += 1
        assert overflows <= 6
    scale = 2.0**16 * 0.5**overflows  # GradScaler's start, halved once per overflow
    assert stepper.loss_scale == scale
    before = snapshot(model, opt)

    def overflow(model, mb):
        out = lm_loss(model, mb)
        return gradstep.LossSum(out.total * 1e38, out.count)

    stats = stepper.step(mbs, overflow)
    assert stats.skipped and "non-finite" in stats.skip_reason
    assert stats.loss_scale == scale * 0.5  # StepStats reports the scale after the back-off
    assert stepper.loss_scale == scale * 0.5
    assert_bitwise_equal(snapshot(model, opt), before)
    assert not stepper.step(mbs, lm_loss).skipped  # recovers


def test_fp16_state_dict_round_trip_keeps_scale_and_counters():
    stepper, _, _, _, _, _ = fp16_run(poison=1e38)
    state = stepper.state_dict()
    model = TinyLM()
    other = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), clip=None,
                             precision="fp16")  # fmt: skip
    other.load_state_dict(state)
    assert other.loss_scale == stepper.loss_scale
    assert other.skipped_steps == 1 and other.state_dict() == state


def test_bf16_autocast_gradient_close_to_fp32_and_kept_in_fp32():
    torch.manual_seed(0)
    model = TinyLM()
    mbs, seqs = make_window(WINDOW, seed=4)
    ref, _ = reference_grads(model, collate(seqs))
    m = copy.deepcopy(model)
    stepper = gradstep.Stepper(m, torch.optim.SGD(m.parameters(), lr=0.0), clip=None,
                               precision="bf16")  # fmt: skip
    stats = stepper.step(mbs, lm_loss)
    grads = [p.grad for p in m.parameters()]
    assert all(g.dtype == torch.float32 for g in grads)
    assert 0 < rel_err(grads, ref) <= 3e-2  # bf16 compute, fp32 gradients
    assert stats.grad_norm == pytest.approx(float(torch.nn.utils.get_total_norm(ref)), rel=3e-2)


def bf16_accumulation_error(k: int, accum_dtype, seed: int) -> float:
    """Relative error vs fp64 of the gradient the optimizer sees after k micro-batches.

    The micro-batch gradients share a common direction (inputs and targets with a mean),
    the regime where summing in bf16 stagnates: once the running sum is ~2^8 times a
    contribution, adding it changes nothing.
    """
    g = torch.Generator().manual_seed(seed)
    model = BF16Linear(32, 16)
    with torch.no_grad():
        model.weight.normal_(0, 0.3, generator=g)
        model.bias.zero_()
    model = model.to(torch.bfloat16)
    ref = copy.deepcopy(model).double()
    mbs = [
        ((torch.randn(4, 32, generator=g) * 0.5 + 1).to(torch.bfloat16),
         torch.randn(4, 16, generator=g) * 0.5 + 2.0)
        for _ in range(k)
    ]  # fmt: skip

    def mse(model, mb):
        x, y = mb
        return gradstep.LossSum(((model(x) - y) ** 2).sum(), y.numel())

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gradstep.Stepper(model, opt, clip=None, accum_dtype=accum_dtype).step(mbs, mse)
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    x = torch.cat([x for x, _ in mbs]).double()
    y = torch.cat([y for _, y in mbs]).double()
    (((ref(x) - y) ** 2).sum() / y.numel()).backward()
    return rel_err([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])


@pytest.mark.parametrize(("k", "factor"), [(64, 3.0), (256, 10.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp32_accumulation_of_bf16_gradients_beats_plain_bf16(k, factor, seed):
    fp32_buffers = bf16_accumulation_error(k, None, seed)  # default: float32 buffers
    plain = bf16_accumulation_error(k, torch.bfloat16, seed)
    assert fp32_buffers < 2.5e-3  # at bf16's own rounding floor (2^-8 relative, RMS ~1.7e-3)
    assert plain >= factor * fp32_buffers


def bf16_mse(model, mb, bias=True):
    """Squared error per row, summed, computed in ``y``'s dtype (float32 for the bf16
    model, float64 for the reference); ``bias=False`` leaves the bias without a gradient
    in that window. Two rows per micro-batch: few items, so a stale buffer is a large error
    (the previous step's mean gradient / this step's item count)."""
    x, y = mb
    w, b = model.weight.to(y.dtype), model.bias.to(y.dtype) if bias else None
    out = nn.functional.linear(x.to(y.dtype), w, b)
    return gradstep.LossSum(((out - y) ** 2).sum(), y.shape[0])


def bf16_mse_no_bias(model, mb):
    return bf16_mse(model, mb, bias=False)


def fp64_window_grads(model, mbs, loss_fn):
    """float64 gradients by name of the window's mean loss (one batch of every row), and
    each micro-batch's share of it (its loss sum / the window's item count)."""
    ref = copy.deepcopy(model).double()
    items = sum(y.shape[0] for _, y in mbs)
    shares = []
    for x, y in mbs:
        ref.zero_grad(set_to_none=True)
        (loss_fn(ref, (x.double(), y.double())).total / items).backward()
        shares.append({n: r.grad.clone() for n, r in ref.named_parameters() if r.grad is not None})
    ref.zero_grad(set_to_none=True)
    x, y = torch.cat([x for x, _ in mbs]).double(), torch.cat([y for _, y in mbs]).double()
    full = loss_fn(ref, (x, y))
    (full.total / full.count).backward()
    grads = {n: r.grad for n, r in ref.named_parameters() if r.grad is not None}
    return grads, shares


@pytest.mark.parametrize("accum_dtype", [None, torch.float64])
def test_bf16_parameter_gradient_is_exact_on_every_step_of_one_stepper(accum_dtype):
    """One Stepper, 4 steps of different lengths (8, 2, 5, 3 micro-batches): the buffers are
    reused, so each step must start from zero. Each step's bf16 ``.grad`` is compared, per
    tensor, with the float64 full-batch gradient at that step's parameters.

    Tolerance, from bf16 rounding alone: autograd writes each micro-batch's share g_i into
    the bf16 ``.grad`` (error <= 2^-9 |g_i| per element), and the buffer's sum is rounded to
    bf16 once at the step (<= 2^-9 |sum g_i|); the float32 compute and sum add ~1e-7. So
    ||err|| / ||g|| <= 2^-9 (|| sum |g_i| || / ||g|| + 1) + 1e-5, ~3.9e-3 on these data
    (gradients sharing a direction). Measured <= 2.5e-3 on every step and tensor. A buffer
    that still holds the previous step's gradient (P1) is 4-10% off from step 2 on, and
    gives the bias a stale gradient in the window that has none.
    """
    g = torch.Generator().manual_seed(0)
    model = BF16Linear(32, 16)
    with torch.no_grad():
        model.weight.normal_(0, 0.3, generator=g)
        model.bias.normal_(0, 0.3, generator=g)
    model = model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # the parameters move between steps
    stepper = gradstep.Stepper(model, opt, clip=None, accum_dtype=accum_dtype)
    assert stepper.accumulator is not None
    for step, k in enumerate([8, 2, 5, 3]):
        mbs = [
            ((torch.randn(2, 32, generator=g) * 0.5 + 1).to(torch.bfloat16),
             torch.randn(2, 16, generator=g) * 0.5 + 2.0)
            for _ in range(k)
        ]  # fmt: skip
        loss_fn = bf16_mse_no_bias if step == 2 else bf16_mse
        want, shares = fp64_window_grads(model, mbs, loss_fn)
        stats = stepper.step(mbs, loss_fn)
        assert not stats.skipped and stats.step == step + 1 and stats.micro_batches == k
        for name, p in model.named_parameters():
            if name not in want:  # step 2 has no bias gradient: none, not a stale one
                assert p.grad is None, (step, name)
                continue
            assert p.grad.dtype == torch.bfloat16
            w = want[name]
            spread = float(sum(s[name].abs() for s in shares).norm() / w.norm())
            tol = 2.0**-9 * (spread + 1.0) + 1e-5
            err = float((p.grad.double() - w).norm() / w.norm())
            assert err <= tol, (step, name, err, tol)


def test_accum_buffers_are_used_and_grads_freed_per_micro_batch():
    model = nn.Linear(4, 3).to(torch.bfloat16)
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
    acc = stepper.accumulator
    assert acc is not None and acc.dtype == torch.float32
    seen = []

    def fn(m, mb):
        seen.append([p.grad for p in m.parameters()])
        return gradstep.LossSum(m(mb).float().sum(), mb.shape[0])

    stepper.step([torch.randn(2, 4).bfloat16() for _ in range(3)], fn)
    assert all(g is None for grads in seen for g in grads)  # moved to the fp32 buffer


def test_bad_precision_arguments():
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="precision must be one of"):
        gradstep.Stepper(model, opt, precision="fp8")
    with pytest.raises(ValueError, match="accum_dtype"):
        gradstep.Stepper(model, opt, accum_dtype=torch.int32)
    half = TinyLM().half()
    with pytest.raises(ValueError, match="fp16.*float32 parameters"):
        gradstep.Stepper(half, torch.optim.SGD(half.parameters(), lr=0.1), precision="fp16")


@pytest.mark.parametrize("case", ["bf16 params", "mixed params", "float64 buffers"])
def test_fp16_refuses_gradients_the_scaler_cannot_unscale(case):
    """GradScaler unscales param.grad only: buffered gradients would stay scaled."""
    model = TinyLM()
    accum = None
    if case == "bf16 params":
        model = model.bfloat16()
    elif case == "mixed params":
        model.head.bfloat16()
    else:
        accum = torch.float64
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fp16.*accum_dtype"):
        gradstep.Stepper(model, opt, precision="fp16", accum_dtype=accum)


def test_accumulation_hooks_live_only_inside_step():
    """A second Stepper, or a plain backward, on the same bf16 model is not hijacked."""
    model = nn.Linear(4, 3).to(torch.bfloat16)
    x = torch.randn(2, 4).bfloat16()

    def fn(m, mb):
        return gradstep.LossSum(m(mb).float().sum(), mb.shape[0])

    first = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
    first.step([x], fn)
    second = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
    second.step([x, x], fn)
    expected = 2 * torch.ones(2, 3).T @ x.float() / 4  # two micro-batches, 4 items
    torch.testing.assert_close(model.weight.grad.float(), expected, rtol=1e-2, atol=1e-2)
    model.zero_grad(set_to_none=True)
    model(x).float().sum().backward()
    assert model.weight.grad is not None  # a plain backward still fills .grad


def test_fp16_step_that_raises_after_unscale_leaves_a_usable_stepper():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper = gradstep.Stepper(model, opt, precision="fp16", clip=gradstep.AGC(exclude=["nope"]))
    mbs, _ = make_window(WINDOW, seed=3)
    before = snapshot(model, opt)
    scale = stepper.loss_scale
    with pytest.raises(ValueError, match="nope"):
        stepper.step(mbs, lm_loss)  # AGC checks exclude names after the unscale
    assert_bitwise_equal(snapshot(model, opt), before)
    assert stepper.loss_scale == scale
    stepper.clip = [gradstep.ClipNorm(1.0)]
    while stepper.step(mbs, lm_loss).skipped:  # the initial 2^16 scale may overflow
        pass
    assert stepper.step_count == 1


def test_fp16_policy_skip_does_not_count_towards_scale_growth():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    always = gradstep.ClipResult(skip="test: always skip", acted=True)

    class SkipAll:
        def clip(self, ctx):
            return always

    stepper = gradstep.Stepper(model, opt, precision="fp16", clip=SkipAll())
    mbs, _ = make_window(WINDOW, seed=3)

    def tracker():
        return stepper.grad_scaler.state_dict()["_growth_tracker"]

    for _ in range(3):
        stats = stepper.step(mbs, lm_loss)
        assert stats.skipped and stats.skip_reason == "test: always skip"
    assert stepper.loss_scale == 2.0**16 and tracker() == 0


def test_the_pre_scale_travels_in_the_precision_state():
    """fp16's pre-scale of the next window is part of ``Precision.state_dict()``: a round
    trip restores it whatever ``prescale=`` says; a state saved without it (the Stepper used
    to keep it apart) takes the argument; fp32/bf16 keep 1 whatever was saved."""
    from gradstep.step.precision import Precision

    params = list(nn.Linear(3, 2).parameters())
    saved = Precision("fp16", params, None, distributed=False)
    assert saved.state_dict()["prescale"] is None  # before the first window: unknown
    saved.end_window(global_micro_batches=4, items=26)
    state = saved.state_dict()
    assert state["prescale"] == 4 / 26 == saved.prescale
    again = Precision("fp16", params, None, distributed=False)
    again.load_state_dict(state, prescale=0.5)
    assert again.prescale == 4 / 26 and again.state_dict() == state
    older = Precision("fp16", params, None, distributed=False)
    older.load_state_dict({"scaler": state["scaler"]}, prescale=0.25)
    assert older.prescale == 0.25
    unknown = Precision("fp16", params, None, distributed=False)
    unknown.load_state_dict({**state, "prescale": None}, prescale=0.25)
    assert unknown.prescale is None  # measured by the first fp16 backward
    plain = Precision("bf16", params, None, distributed=False)
    plain.load_state_dict(state, prescale=0.25)
    assert plain.prescale == 1.0 and plain.state_dict() == {"scaler": None, "prescale": 1.0}
