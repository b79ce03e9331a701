"""Parity of the accumulated step with one big batch, and the step's bookkeeping."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradstep
from tests.support.asserts import assert_bitwise_equal, flat, rel_err, snapshot
from tests.support.batches import collate, make_window, rows
from tests.support.models import TinyLM
from tests.support.reference import lm_loss, reference_grads, reference_step

# Per micro-batch: 1-3 sequences of 1-12 tokens; some micro-batches get very few tokens,
# so a mean of per-micro-batch means would weight tokens unequally.
lengths_strategy = st.lists(st.integers(1, 12), min_size=1, max_size=3)


def window_lengths(k: int):
    return st.lists(lengths_strategy, min_size=k, max_size=k)


def stepper_grads(model, mbs, **kw):
    """Gradient the optimizer would see: SGD with lr=0 leaves params, keeps .grad."""
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    stepper = gradstep.Stepper(m, opt, clip=None, **kw)
    stats = stepper.step(mbs, lm_loss)
    return [None if p.grad is None else p.grad.detach().clone() for p in m.parameters()], stats


@pytest.mark.parametrize("k", [1, 2, 3, 7])
@given(data=st.data())
def test_accumulated_gradient_equals_full_batch_fp32(k, data):
    lengths = data.draw(window_lengths(k))
    torch.manual_seed(1)
    model = TinyLM()
    mbs, seqs = make_window(lengths, seed=k)
    ref, ref_loss = reference_grads(model, collate(seqs))
    got, stats = stepper_grads(model, mbs)
    assert stats.items == sum(int((s[1] != -100).sum()) for s in seqs)
    if stats.items == 0:
        assert stats.skipped
        return
    assert rel_err(got, ref) <= 1e-6
    assert stats.loss == pytest.approx(ref_loss, rel=1e-6)
    assert stats.micro_batches == k


@pytest.mark.parametrize("k", [1, 2, 3, 7])
@given(data=st.data())
def test_accumulated_gradient_equals_full_batch_fp64(k, data):
    lengths = data.draw(window_lengths(k))
    torch.manual_seed(2)
    model = TinyLM().double()
    mbs, seqs = make_window(lengths, seed=10 + k)
    items = sum(int((s[1] != -100).sum()) for s in seqs)
    got, stats = stepper_grads(model, mbs)
    assert stats.items == items
    if items == 0:  # every label ignored: the step is skipped, not compared
        assert stats.skipped and "0 items" in stats.skip_reason
        return
    ref, ref_loss = reference_grads(model, collate(seqs))
    assert rel_err(got, ref) <= 1e-12
    assert stats.loss == pytest.approx(ref_loss, rel=1e-12)


# Per k, a max_norm between the pre-clip norms of the 3 steps (norms of the reference,
# k=1: 1.38, 1.38, 0.88; k=2: 0.55, 0.47, 0.59; k=3: 0.44, 0.33, 0.48; k=7: 0.26, 0.24,
# 0.27), so ClipNorm acts on some steps and not on others. Were it to act on every step,
# clipping and AdamW's scale invariance would hide any error in the gradient's scale.
ADAMW_MAX_NORM = {1: 1.0, 2: 0.5, 3: 0.45, 7: 0.25}
# The AdamW update of each step (params after - params before, all of them at once), fp32
# against the fp32 full-batch step: measured <= 6.4e-7 (k=2, step 2). AdamW divides by
# sqrt(v), so an element with a gradient near eps turns float32 rounding into a visible
# update difference; 2e-6 leaves room for that. Normalising by the micro-batch count
# instead of the item count (M1) is 8e-3 to 1e-1 off from step 2 on, for every k.
UPDATE_TOL = 2e-6


def flat64(model):
    """Every parameter in one float64 vector (a copy)."""
    return flat(list(model.parameters())).detach().double()


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_parameters_after_three_adamw_steps_match_full_batch(k):
    torch.manual_seed(3)
    max_norm = ADAMW_MAX_NORM[k]
    model = TinyLM()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(max_norm))
    clipped = []
    for step in range(3):
        lengths = [[1 + (3 * i + step) % 9, 2 + (5 * i) % 7] for i in range(k)]
        mbs, seqs = make_window(lengths, seed=100 + step)
        before, ref_before = flat64(model), flat64(ref_model)
        stats = stepper.step(mbs, lm_loss)
        ref = reference_step(ref_model, collate(seqs), ref_opt, max_norm=max_norm)
        assert stats.grad_norm == pytest.approx(ref["grad_norm"], rel=1e-6), step
        assert stats.clip_coef == pytest.approx(ref["clip_coef"], rel=1e-6), step
        assert stats.clipped == (ref["clip_coef"] < 1.0), step
        clipped.append(stats.clipped)
        update, ref_update = flat64(model) - before, flat64(ref_model) - ref_before
        assert rel_err(update, ref_update) <= UPDATE_TOL, step
    assert any(clipped) and not all(clipped), clipped  # guard: the max_norm above
    assert rel_err(list(model.parameters()), list(ref_model.parameters())) <= 1e-6


def test_mean_of_means_would_be_wrong_here():
    """Guard that the data exercise token weighting: k * mean-of-means differs a lot."""
    model = TinyLM()
    mbs, seqs = make_window([[1], [12, 12, 12]], seed=5)
    ref, _ = reference_grads(model, collate(seqs))
    m = copy.deepcopy(model)
    for mb in mbs:
        out = lm_loss(m, mb)
        (out.total / out.count / len(mbs)).backward()
    assert rel_err([p.grad for p in m.parameters()], ref) > 1e-2


def test_short_last_window_equals_one_batch_of_exactly_those_items():
    """8 micro-batches in windows of 3: the last window is 2 micro-batches, accumulated and
    divided by its own item count (not by 3 micro-batches' worth, not per micro-batch)."""
    torch.manual_seed(4)
    model = TinyLM()
    mbs, _ = make_window([[3, 5], [7], [2, 2], [9], [4, 6], [8], [1, 11], [2]], seed=7)
    windows = list(gradstep.windows(iter(mbs), 3))
    assert [len(w) for w in windows] == [3, 3, 2]
    m = copy.deepcopy(model)
    stepper = gradstep.Stepper(m, torch.optim.SGD(m.parameters(), lr=0.0), clip=None)
    for window in windows:  # one Stepper, as a training loop would run it
        ref_batch = collate([row for mb in window for row in rows(mb)])
        ref, ref_loss = reference_grads(model, ref_batch)
        stats = stepper.step(window, lm_loss)
        assert stats.micro_batches == len(window)
        assert stats.items == int((ref_batch["labels"] != -100).sum())
        assert stats.loss == pytest.approx(ref_loss, rel=1e-6)
        assert rel_err([p.grad for p in m.parameters()], ref) <= 1e-6


def test_windows_groups_any_iterable_lazily():
    stream = iter(range(10))
    w = gradstep.windows(stream, 4)
    assert next(w) == [0, 1, 2, 3]
    assert next(stream) == 4  # nothing read ahead beyond the window
    assert list(gradstep.windows(range(6), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(gradstep.windows([], 3)) == []


def test_window_length_may_change_between_calls():
    model = TinyLM()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for k in (1, 4, 2):
        mbs, _ = make_window([[4]] * k, seed=k)
        assert stepper.step(mbs, lm_loss).micro_batches == k
    assert stepper.step_count == 3


@pytest.mark.parametrize("lengths", [[[4], [6]], [[1], [2], [3], [4], [5]], [[7]]])
def test_scheduler_steps_once_per_optimizer_step(lengths):
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    stepper = gradstep.Stepper(model, opt, scheduler=sched)
    seen = []
    for i in range(3):
        mbs, _ = make_window(lengths, seed=i)
        stats = stepper.step(mbs, lm_loss)
        seen.append(stats.lr)
    assert sched.last_epoch == 3
    assert seen == [1.0, 0.5, 0.25]  # the lr used by each step, not the next one


def test_zero_item_micro_batches_are_fine_and_empty_window_skips():
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = gradstep.Stepper(model, opt)
    mbs, seqs = make_window([[5], [3]], seed=3)
    mbs[0]["labels"][:] = -100  # a micro-batch with zero items
    ref, _ = reference_grads(model, collate([(x, y) for x, y in seqs[1:]]))
    got, stats = stepper_grads(model, mbs)
    assert stats.items == int((mbs[1]["labels"] != -100).sum())
    assert rel_err(got, ref) <= 1e-6
    for mb in mbs:
        mb["labels"][:] = -100
    before = snapshot(model, opt)
    stats = stepper.step(mbs, lm_loss)
    assert stats.skipped and stats.items == 0 and "0 items" in stats.skip_reason
    assert stepper.skipped_steps == 1 and stepper.step_count == 0
    assert_bitwise_equal(snapshot(model, opt), before)


def test_step_stats_fields():
    model = TinyLM()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mbs, seqs = make_window([[5, 2], [3]], seed=1)
    ref, ref_loss = reference_grads(model, collate(seqs))
    stats = stepper.step(mbs, lm_loss)
    assert stats.items == sum(int((y != -100).sum()) for _, y in seqs)
    assert stats.micro_batches == 2 and stats.step == 1 and not stats.skipped
    assert stats.loss == pytest.approx(ref_loss, rel=1e-6)
    assert stats.grad_norm == pytest.approx(float(torch.nn.utils.get_total_norm(ref)), rel=1e-6)
    # The default ClipNorm(1.0) against clip_grad_norm_'s coefficient from the reference norm.
    ref_norm = float(torch.nn.utils.get_total_norm(ref))
    expected_coef = min(1.0, 1.0 / (ref_norm + 1e-6))
    assert stats.clip_coef == pytest.approx(expected_coef, rel=1e-6)
    assert stats.clipped == (ref_norm > 1.0)
    assert stats.post_clip_norm == pytest.approx(ref_norm * expected_coef, rel=1e-6)
    assert stats.lr == 0.1 and stats.skip_reason is None and stats.clip_threshold == 1.0


# -------------------------------------------- found by the held-out check of the refactor


def _counted_up_front(model, mb):  # noqa: ANN001, ANN202
    return gradstep.LossSum(lm_loss(model, mb).total, None)


class _SeenCounts:
    def __init__(self) -> None:
        self.seen: list = []

    def on_micro_batch_end(self, stepper, index, is_last, loss) -> None:  # noqa: ANN001
        self.seen.append(loss.count)


def test_hooks_see_the_count_that_count_fn_gave_a_loss_without_one() -> None:
    """``LossSum(total, None)`` with ``step(count=fn)``: ``on_micro_batch_end`` gets the
    counted value, and the noise-scale hook (which reads it) measures what it measures with
    the counts returned by the loss."""
    mbs, _ = make_window([[3, 5], [2], [4, 1, 6]], seed=2)
    count = lambda mb: int((mb["labels"] != -100).sum())  # noqa: E731
    runs = {}
    for name, loss_fn in (("returned", lm_loss), ("counted", _counted_up_front)):
        torch.manual_seed(0)
        model = TinyLM()
        hook = _SeenCounts()
        gns = gradstep.GradientNoiseScale()
        stepper = gradstep.Stepper(
            model, torch.optim.SGD(model.parameters(), lr=0.1), hooks=[hook, gns]
        )
        for _ in range(2):
            stepper.step(mbs, loss_fn, count=count)
        runs[name] = ([int(c) for c in hook.seen], gns.state_dict())
    assert runs["counted"][0] == runs["returned"][0] == [count(mb) for mb in mbs] * 2
    assert runs["counted"][1] == runs["returned"][1]


def test_what_the_stepper_was_built_with_cannot_be_reassigned_silently() -> None:
    model = TinyLM()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    built = {"on_oom": "split", "split_fn": lambda mb: (mb, mb), "norm_in_backward": True}
    for name, value in built.items():
        with pytest.raises(AttributeError, match=f"Stepper.{name} is fixed when it is built"):
            setattr(stepper, name, value)
    assert stepper.on_oom == "raise" and stepper.norm_in_backward is False
    stepper.clip = gradstep.ClipNorm(0.5)  # the clip policies stay assignable


def test_a_window_that_is_not_iterable_is_named() -> None:
    model = TinyLM()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="micro_batches must be an iterable"):
        stepper.step(5, lm_loss)
