"""The observer seam (Stepper hooks=), explicit strategies and the clip setter."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import gradstep
from gradstep.parallel import LocalStrategy
from gradstep.step.hooks import HOOK_POINTS, Hooks
from tests.support.asserts import assert_bitwise_equal, rel_err, snapshot
from tests.support.batches import collate, make_window
from tests.support.models import TinyLM
from tests.support.reference import failing_loss, lm_loss, reference_grads

WINDOW = [[3, 5], [7], [2, 2, 6]]


class Recorder:
    """Every hook point, recorded in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.param_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.steps_seen = 0

    def on_step_start(self, stepper):
        self.events.append(("start",))
        self.param_grads = {}

    def on_param_grad(self, stepper, index, name, param, grad):
        self.param_grads.setdefault(index, {})[name] = grad.detach().clone()

    def on_micro_batch_end(self, stepper, index, is_last, loss):
        self.events.append(("mb", index, is_last, float(loss.total.detach()), int(loss.count)))

    def on_norm(self, stepper, view):
        grads = [g * view.pending_scale for g in view.raw_grads()]
        self.events.append(("norm", view.norm, grads))

    def on_step_end(self, stepper, stats):
        self.events.append(("end", stats))
        self.steps_seen += 1

    def state_dict(self):
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state):
        self.steps_seen = state["steps_seen"]


def _model(dtype=torch.float64) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().to(dtype)


def test_hook_points_run_in_step_order_with_their_arguments():
    model = _model()
    rec = Recorder()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), hooks=[rec])
    mbs, seqs = make_window(WINDOW, seed=1)
    ref, _ = reference_grads(model, collate(seqs))
    counts = [int((mb["labels"] != -100).sum()) for mb in mbs]
    stats = stepper.step(mbs, lm_loss)
    kinds = [e[0] for e in rec.events]
    assert kinds == ["start", "mb", "mb", "mb", "norm", "end"]
    assert [e[1:3] for e in rec.events[1:4]] == [(0, False), (1, False), (2, True)]
    assert [e[4] for e in rec.events[1:4]] == counts
    assert sum(e[3] for e in rec.events[1:4]) / sum(counts) == pytest.approx(stats.loss, rel=1e-12)
    _, norm, normalised = rec.events[4]
    assert norm == stats.grad_norm
    # What on_norm reads is the normalised, pre-clip gradient of the full batch.
    assert rel_err(normalised, ref) < 1e-12
    assert rec.events[5][1] is stats


def test_on_param_grad_lends_each_micro_batch_its_own_gradient():
    model = _model()
    rec = Recorder()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), hooks=[rec])
    mbs, _ = make_window(WINDOW, seed=2)
    stepper.step(mbs, lm_loss)
    assert sorted(rec.param_grads) == [0, 1, 2]
    for i, mb in enumerate(mbs):
        alone = copy.deepcopy(model)
        lm_loss(alone, mb).total.backward()
        for name, p in alone.named_parameters():
            seen = rec.param_grads[i][name]
            assert torch.allclose(seen, p.grad, rtol=1e-12, atol=1e-15), (i, name)


def test_hooks_never_change_the_update_and_see_skipped_steps():
    mbs, _ = make_window(WINDOW, seed=3)
    runs = []
    for hooks in ([], [Recorder()]):
        model = _model(torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stepper = gradstep.Stepper(model, opt, hooks=hooks)
        for _ in range(2):
            stepper.step(mbs, lm_loss)
        runs.append((snapshot(model, opt), hooks))
    assert_bitwise_equal(runs[0][0], runs[1][0])
    rec = runs[1][1][0]
    model = _model(torch.float32)
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), hooks=[rec])

    def nan_loss(m, mb):
        total, count = lm_loss(m, mb)
        return gradstep.LossSum(total * math.nan, count)

    stats = stepper.step(mbs, nan_loss)
    assert stats.skipped and rec.events[-1] == ("end", stats)
    assert "norm" not in [e[0] for e in rec.events[-5:]]  # no norm to observe on a skip


def test_hook_state_travels_in_the_stepper_state_dict():
    model = _model()
    rec = Recorder()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), hooks=[rec])
    mbs, _ = make_window(WINDOW, seed=4)
    stepper.step(mbs, lm_loss)
    stepper.step(mbs, lm_loss)
    state = stepper.state_dict()
    other = Recorder()
    fresh = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), hooks=[other])
    fresh.load_state_dict(state)
    assert other.steps_seen == 2
    bare = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="hooks="):
        bare.load_state_dict(state)


@pytest.mark.parametrize("bad", [object(), Recorder, "on_step_end", 3])
def test_bad_hooks_are_refused_naming_the_parameter(bad):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="hooks"):
        gradstep.Stepper(model, opt, hooks=bad if bad == 3 else [bad])


def test_a_window_that_raises_leaves_no_gradient_hook_behind():
    model = _model()
    rec = Recorder()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), hooks=[rec])
    mbs, _ = make_window(WINDOW, seed=5)

    fails_second = failing_loss(2, "boom")
    with pytest.raises(RuntimeError, match="boom"):
        stepper.step(mbs, fails_second)
    rec.param_grads = {}
    lm_loss(model, mbs[0]).total.backward()  # the user's own backward: no hook fires
    assert rec.param_grads == {}


def test_explicit_strategy_is_used_and_checked():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = LocalStrategy()
    stepper = gradstep.Stepper(model, opt, strategy=strategy)
    assert stepper.strategy is strategy
    mbs, seqs = make_window(WINDOW, seed=6)
    ref, _ = reference_grads(model, collate(seqs))
    before = [p.detach().clone() for p in model.parameters()]
    stepper.clip = None
    stepper.step(mbs, lm_loss)
    update = [(b - p.detach()) / 0.1 for b, p in zip(before, model.parameters(), strict=True)]
    assert rel_err(update, ref) < 1e-12
    with pytest.raises(TypeError, match="strategy must be"):
        gradstep.Stepper(model, opt, strategy="ddp")


def test_assigning_clip_validates_and_recomputes_the_norm_type():
    mbs, _ = make_window(WINDOW, seed=7)
    inf_policy = [gradstep.ClipNorm(1e9, norm_type=math.inf)]
    norms = []
    for assign in (False, True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        if assign:
            stepper = gradstep.Stepper(model, opt)
            stepper.clip = inf_policy
        else:
            stepper = gradstep.Stepper(model, opt, clip=inf_policy)
        norms.append(stepper.step(mbs, lm_loss).grad_norm)
    assert norms[0] == norms[1]
    model = _model()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
    l2 = stepper.step(mbs, lm_loss).grad_norm
    assert norms[0] < l2  # the inf-norm, not the L2 norm
    with pytest.raises(TypeError, match="clip must be"):
        stepper.clip = ["not a policy"]
    with pytest.raises(TypeError, match="the class ClipNorm"):
        stepper.clip = gradstep.ClipNorm
    assert stepper.clip == []  # a refused assignment changes nothing


def test_each_hook_point_holds_the_bound_methods_of_the_hooks_that_have_it():
    """``Hooks`` declares one attribute per point: the methods, in the hooks' order, of the
    hooks defining that point; an empty tuple (nothing to call) for the others."""

    class Start:
        def on_step_start(self, stepper):
            pass

    class Both(Start):
        def on_norm(self, stepper, view):
            pass

    a, b = Start(), Both()
    hooks = Hooks([a, b])
    assert hooks.on_step_start == (a.on_step_start, b.on_step_start)
    assert hooks.on_norm == (b.on_norm,)
    assert hooks.on_param_grad == hooks.on_micro_batch_end == hooks.on_step_end == ()
    assert {p: getattr(Hooks([]), p) for p in HOOK_POINTS} == dict.fromkeys(HOOK_POINTS, ())
    assert list(hooks) == hooks.items == [a, b] and len(hooks) == 2
